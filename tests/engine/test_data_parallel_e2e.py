"""Data parallelism through the real processes on CPU: `tokenmill serve --data-parallel-size 2` and
`LLM(data_parallel_size=2)` generate what transformers (and one replica) generate; the replicas report their own
metrics; and a replica whose worker dies is taken out of rotation while the other keeps serving.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.helpers.api_helpers import metric_samples
from tests.helpers.reference import assert_greedy_match, hf_greedy_reference, load_reference_model
from tests.helpers.server import Server, alive

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "1, 2, 3, 4, 5,",
]
NEW_TOKENS = 12
# prompts shorter than a block (nothing to match or cache): the router sends them by load, so to both replicas
FRESH = ["Tell me a story about a dragon.", "Why is the sea salty?"]
SERVER_ARGS = (
    "--served-model-name",
    "m",
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--kv-cache-memory-bytes",
    "64MiB",
    "--data-parallel-size",
    "2",
)


def complete(url: str, prompt, **extra) -> requests.Response:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    return requests.post(f"{url}/v1/completions", json=body, timeout=120)


def replica_of(pid: int) -> int | None:
    """Which replica a child belongs to: each replica's children see their own CUDA_VISIBLE_DEVICES slice."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"CUDA_VISIBLE_DEVICES="):
            return int(entry.split(b"=", 1)[1] or -1)
    return None


def child_of_replica(server: Server, role: str, replica: int) -> int:
    for pid in server.children():
        try:
            if open(f"/proc/{pid}/comm").read().strip() == f"tm-{role}" and replica_of(pid) == replica:
                return pid
        except OSError:
            continue
    raise AssertionError(f"no tm-{role} of replica {replica} among {server.children()}")


def engine_samples(url: str, name: str) -> dict[str, float]:
    return {
        dict(labels)["engine"]: value
        for (sample, labels), value in metric_samples(url).items()
        if sample == name and "engine" in dict(labels)
    }


def test_two_replicas_match_transformers_and_survive_one_dying(tiny_checkpoints, smollm2_tokenizer, tmp_path):
    prompts = [smollm2_tokenizer.encode(text) for text in TEXTS]
    model = load_reference_model("llama", tiny_checkpoints)
    expected = [hf_greedy_reference(model, prompt, NEW_TOKENS) for prompt in prompts]
    with Server(
        str(tiny_checkpoints("llama")), *SERVER_ARGS, log_path=tmp_path / "server.log", startup_timeout=300
    ) as server:
        kids = server.children()
        assert len(kids) == 4  # two replicas, each a scheduler and a worker
        assert requests.get(f"{server.url}/health", timeout=10).text == ""  # healthy: vLLM's empty 200

        with ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(lambda prompt: complete(server.url, prompt), prompts))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        for response, reference in zip(responses, expected):
            assert_greedy_match(response.json()["choices"][0]["token_ids"], reference)
        # n > 1: both greedy choices of one request come back (from one replica) and agree
        both = complete(server.url, prompts[0], n=2).json()["choices"]
        assert both[0]["token_ids"] == both[1]["token_ids"] == responses[0].json()["choices"][0]["token_ids"]

        # each replica reports its own scheduler metrics; requests reached both
        routed = {}
        for (sample, labels), value in metric_samples(server.url).items():
            if sample == "tokenmill:data_parallel_routed_requests_total":
                routed[dict(labels)["engine"]] = routed.get(dict(labels)["engine"], 0) + value
        assert routed["0"] >= 1 and routed["1"] >= 1 and sum(routed.values()) == len(prompts) + 1, routed
        deadline = time.monotonic() + 10
        while min(engine_samples(server.url, "vllm:prefix_cache_queries_total").values()) == 0:
            assert time.monotonic() < deadline, "a replica never reported its prefix-cache queries"
            time.sleep(0.2)
        assert engine_samples(server.url, "tokenmill:engine_alive") == {"0": 1.0, "1": 1.0}

        # replica 1's worker hangs (SIGSTOP), then dies mid-request: two requests land on different replicas (the
        # least loaded gets the second); the one on replica 1 must end with an error, fast, and the other finish
        victim = child_of_replica(server, "worker0", 1)
        scheduler1 = child_of_replica(server, "scheduler", 1)
        os.kill(victim, signal.SIGSTOP)
        outcome: dict[int, dict] = {0: {}, 1: {}}

        def stream(index: int) -> None:
            try:
                with requests.post(
                    f"{server.url}/v1/completions",
                    stream=True,
                    timeout=60,
                    json={"model": "m", "prompt": FRESH[index], "max_tokens": 50, "ignore_eos": True, "stream": True},
                ) as response:
                    outcome[index]["status"] = response.status_code
                    outcome[index]["body"] = b"".join(response.iter_content(None)).decode(errors="replace")
            except requests.RequestException as exc:
                outcome[index]["exception"] = repr(exc)
            outcome[index]["ended"] = time.monotonic()

        threads = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
            time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "an in-flight request hung"
        failed = [o for o in outcome.values() if "exception" in o or '"error"' in o.get("body", "")]
        finished = [
            o
            for o in outcome.values()
            if o.get("body", "").rstrip().endswith("data: [DONE]") and '"error"' not in o["body"]
        ]
        assert len(failed) == 1 and len(finished) == 1, outcome
        assert failed[0]["ended"] - killed_at < 10, "the dead replica's request did not end fast"

        # the instance serves on, says it is degraded, and its metrics show replica 1 gone
        assert server.proc.poll() is None
        health = requests.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert {r["engine"]: r["healthy"] for r in health.json()["replicas"]} == {"0": True, "1": False}
        for prompt, reference in zip(prompts, expected):
            response = complete(server.url, prompt)
            assert response.status_code == 200, response.text
            assert_greedy_match(response.json()["choices"][0]["token_ids"], reference)
        assert engine_samples(server.url, "tokenmill:engine_alive") == {"0": 1.0, "1": 0.0}
        assert engine_samples(server.url, "vllm:num_requests_running")["1"] == 0
        deadline = time.monotonic() + 10  # the dead replica's scheduler is stopped, not left behind
        while alive(scheduler1):
            assert time.monotonic() < deadline, "the dead replica's scheduler was left running"
            time.sleep(0.2)
        assert alive(child_of_replica(server, "scheduler", 0))
        log = server.log_tail(30_000)
        assert "data-parallel replica 1 died" in log, log
    time.sleep(0.5)
    assert [pid for pid in kids if alive(pid)] == [], "orphan processes left behind"


def test_offline_two_replicas_match_transformers(tiny_checkpoints, smollm2_tokenizer):
    from tokenmill import LLM, SamplingParams

    prompts = [smollm2_tokenizer.encode(text) for text in TEXTS] * 2
    model = load_reference_model("qwen2", tiny_checkpoints)
    expected = [hf_greedy_reference(model, prompt, NEW_TOKENS) for prompt in prompts[: len(TEXTS)]] * 2
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(
        str(tiny_checkpoints("qwen2")),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
        data_parallel_size=2,
    ) as llm:
        assert len(llm.processes.children) == 4
        outputs = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        decisions = llm._engines.router.decisions
    for ours, reference in zip(outputs, expected):
        assert_greedy_match(ours, reference)
    assert outputs[: len(TEXTS)] == outputs[len(TEXTS) :]
    assert sum(sum(counts) for counts in decisions.values()) == len(prompts)
    assert all(sum(counts[r] for counts in decisions.values()) > 0 for r in (0, 1)), decisions
