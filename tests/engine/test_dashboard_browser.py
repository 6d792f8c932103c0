"""The dashboard in a real headless browser (Debian's chromium driven by selenium) against a real server under load.

`scripts/install_test_browser.sh` (run by the README's test command) installs chromium and chromium-driver. The test
opens /dashboard with the API key as `?token=`, runs a workload that fills the KV cache past preemption (a shared
prompt prefix, chunked prefill, more tokens than fit), checks that the page keeps receiving updates and draws what
the summaries say, then, once the engine is idle, that the page's block grid and counters match /metrics.

TOKENMILL_DASHBOARD_SCREENSHOT=docs/dashboard.png also saves the screenshot taken under load there (the README's).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest
import requests

from tests.helpers.api_helpers import metric_samples
from tests.helpers.server import Server

pytestmark = pytest.mark.slow

KEY = "sk-dashboard-test"
MAX_TOKENS = 150
SHARED_PREFIX = (
    "You are a careful assistant for a shipping company. Answer in full sentences, cite the relevant "
    "rule, and keep every answer under a hundred words. "
) * 3
QUESTIONS = [
    "Where is my parcel?",
    "Can I change the delivery address?",
    "What does express cost?",
    "How are fragile items packed?",
    "Do you ship to islands?",
    "What if nobody is home?",
    "Can I return a damaged item?",
    "How long is the warranty?",
    "Who pays customs fees?",
    "Can I track a pallet?",
    "Is Sunday delivery possible?",
    "What is the weight limit?",
]


@pytest.fixture(scope="module")
def browser():
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and chromedriver, "no chromium/chromedriver: run scripts/install_test_browser.sh"
    os.environ["SE_OFFLINE"] = "true"  # selenium must never fetch a browser or a driver of its own
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1440,1080",
        "--force-device-scale-factor=1",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dashboard") / "server.log"
    # 64 MiB of KV is 91 blocks of SmolLM2 (1,456 tokens): 12 requests of ~93 + 150 tokens (64 of them a shared,
    # cached prefix) outgrow it about halfway, so some are preempted and recomputed; 128-token chunks make prefill
    # steps show next to decode steps
    with Server(
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        "64MiB",
        "--max-num-seqs",
        "12",
        "--max-num-batched-tokens",
        "128",
        "--api-key",
        KEY,
        log_path=log,
    ) as s:
        yield s


def panel_state(driver) -> dict:
    """The engine panel's counters as the page shows them: its data attributes and the visible legend numbers."""
    return driver.execute_script("""
        const panel = document.querySelector('section.engine[data-engine="0"]');
        if (!panel) return {updates: Number(document.body.dataset.updates)};
        const text = sel => panel.querySelector(sel).textContent;
        return Object.assign({}, panel.dataset, {
            updates: Number(document.body.dataset.updates),
            shownFree: text('.blk-free'), shownCached: text('.blk-cached'), shownUsed: text('.blk-used'),
            shownTotal: text('.blk-total'), shownRunning: text('.n-running'), shownWaiting: text('.n-waiting'),
            queueRows: panel.querySelectorAll('tbody.queue tr[data-status]').length,
            canvasWidth: panel.querySelector('canvas.grid').width});
    """)


def wait_for(driver, predicate, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    state = panel_state(driver)
    while not predicate(state):
        assert time.monotonic() < deadline, f"timed out waiting for {what}; page state: {state}"
        time.sleep(0.1)
        state = panel_state(driver)
    return state


@pytest.mark.timeout(1200)  # a shared CPU can make the workload's ~200 steps slow
def test_dashboard_in_a_browser_under_load(browser, server, tmp_path):
    # without the key the page is an error; with it as ?token= the browser gets a cookie and the bare URL
    browser.get(f"{server.url}/dashboard")
    assert "Invalid or missing API key" in browser.page_source
    browser.get(f"{server.url}/dashboard?token={KEY}")
    assert browser.current_url == f"{server.url}/dashboard"
    assert browser.get_cookie("tokenmill_dashboard")["httpOnly"]
    idle = wait_for(browser, lambda s: s["updates"] >= 1 and "blocksTotal" in s, 30, "a first update")
    num_blocks = int(idle["blocksTotal"])
    assert num_blocks > 80 and idle["blocksUsed"] == "0" and idle["running"] == "0"

    async def workload() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=600) as client:
            return await asyncio.gather(
                *[
                    client.completions.create(
                        model="SmolLM2-135M-Instruct",
                        prompt=SHARED_PREFIX + question,
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                        extra_body={"ignore_eos": True, "priority": i % 3},
                    )
                    for i, question in enumerate(QUESTIONS)
                ],
                return_exceptions=True,
            )

    results: list = []
    worker = threading.Thread(target=lambda: results.extend(asyncio.run(workload())))
    worker.start()
    try:
        busy = wait_for(
            browser,
            lambda s: not worker.is_alive() or (int(s.get("running", 0)) >= 1 and int(s.get("blocksUsed", 0)) > 0),
            120,
            "requests running",
        )
        assert worker.is_alive(), f"the workload ended before the page saw it run: {results}"
        # the page keeps receiving updates while the workload runs, and draws what they carry
        seen_steps = {int(busy["stepId"])}
        samples = []
        full = None
        deadline = time.monotonic() + 900
        while worker.is_alive() and time.monotonic() < deadline:
            state = panel_state(browser)
            seen_steps.add(int(state["stepId"]))
            metrics = metric_samples(server.url, KEY)
            samples.append((int(state["blocksUsed"]) / num_blocks, metrics[("vllm:kv_cache_usage_perc", ())]))
            assert int(state["blocksFree"]) + int(state["blocksCached"]) + int(state["blocksUsed"]) == num_blocks
            assert (state["shownUsed"], state["shownRunning"]) == (state["blocksUsed"], state["running"])
            assert state["queueRows"] == min(int(state["running"]) + int(state["waiting"]), 256)
            # the screenshot: a full pool, requests running and waiting, and a preemption on the timeline
            if (
                full is None
                and int(state["running"]) >= 3
                and int(state["waiting"]) >= 1
                and int(state["blocksUsed"]) > num_blocks // 2
                and int(state["preemptions"]) > 0
            ):
                time.sleep(1.5)  # a few more steps: the preempted requests' recompute shows as prefill
                full = tmp_path / "dashboard.png"
                browser.save_screenshot(str(full))
            time.sleep(0.3)
    finally:
        worker.join(600)
    assert not worker.is_alive()
    assert len(results) == len(QUESTIONS)
    for value in results:
        assert not isinstance(value, Exception), repr(value)
        assert value.usage.completion_tokens == MAX_TOKENS
    assert len(seen_steps) >= 5, f"the page saw too few distinct steps: {sorted(seen_steps)}"
    assert full is not None, "the page never showed a full pool with running and waiting requests, and a preemption"
    # sampled at nearly the same time, the grid and /metrics agree roughly (the metrics lag up to half a second)
    assert any(used > 0.3 and abs(used - usage) < 0.15 for used, usage in samples), samples

    # idle: the page's grid and counters match /metrics exactly
    def metrics_now():
        m = metric_samples(server.url, KEY)
        return m, next(float(dict(labels)["num_gpu_blocks"]) for name, labels in m if name == "vllm:cache_config_info")

    deadline = time.monotonic() + 30
    while True:
        metrics, gpu_blocks = metrics_now()
        state = panel_state(browser)
        expected = {
            "running": int(metrics[("vllm:num_requests_running", ())]),
            "waiting": int(metrics[("vllm:num_requests_waiting", ())]),
            "blocksUsed": round(metrics[("vllm:kv_cache_usage_perc", ())] * gpu_blocks),
            "blocksTotal": int(gpu_blocks),
            "prefixQueries": int(metrics[("vllm:prefix_cache_queries_total", ())]),
            "prefixHits": int(metrics[("vllm:prefix_cache_hits_total", ())]),
        }
        got = {key: int(state[key]) for key in expected}
        if got == expected and expected["running"] == expected["waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"page {got} never matched /metrics {expected}"
        time.sleep(0.2)
    assert got["blocksTotal"] == num_blocks and got["blocksUsed"] == 0
    assert int(state["blocksCached"]) > 0  # finished requests leave their blocks cached, evictable
    assert got["prefixHits"] > 0  # the shared prefix was found in the cache
    shown_rate = browser.find_element("css selector", 'section.engine[data-engine="0"] .hit-rate').text
    assert shown_rate.startswith(f"{100 * got['prefixHits'] / got['prefixQueries']:.1f}%")
    preemptions = browser.find_element("css selector", 'section.engine[data-engine="0"] .n-preempt').text
    assert int(preemptions.replace(",", "")) == int(metrics[("vllm:num_preemptions_total", ())])

    target = os.environ.get("TOKENMILL_DASHBOARD_SCREENSHOT")
    if target:
        Path(target).write_bytes(full.read_bytes())


def test_debug_steps_streams_json_lines_to_scripts(server):
    """The same feed for scripts: JSON lines with the documented fields, behind the key."""
    assert requests.get(f"{server.url}/debug/steps?limit=1", timeout=10).status_code == 401
    with requests.get(
        f"{server.url}/debug/steps?limit=3", headers={"Authorization": f"Bearer {KEY}"}, stream=True, timeout=30
    ) as resp:
        assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [line for line in resp.iter_lines() if line]
    import base64
    import json

    assert len(lines) == 3
    update = json.loads(lines[-1])
    raw = base64.b64decode(update["blocks"]["map"])
    assert len(raw) == update["blocks"]["num_blocks"]
    assert update["blocks"]["used"] == sum(1 for code in raw if code >= 2)
    assert update["blocks"]["cached"] == raw.count(1) and update["blocks"]["free"] == raw.count(0)
    assert update["model"] == "SmolLM2-135M-Instruct" and update["engine"] == 0
