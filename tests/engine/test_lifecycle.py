"""Process lifecycle with real processes: start, signals, a child killed with SIGKILL, two instances side by side."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
import requests

from tests.helpers.server import Server, alive, child_by_role

pytestmark = pytest.mark.slow

TINY_ARGS = ("--kv-cache-memory-bytes", "64MiB", "--max-model-len", "512")


def complete(url: str, max_tokens: int = 4) -> requests.Response:
    return requests.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0},
    )


@pytest.fixture
def tiny_llama(tiny_checkpoints):
    return str(tiny_checkpoints("llama"))


def test_sigterm_and_sigint_stop_everything(tiny_llama, tmp_path):
    for sig in (signal.SIGTERM, signal.SIGINT):
        with Server(tiny_llama, "--served-model-name", "tiny", *TINY_ARGS, log_path=tmp_path / "log") as server:
            assert complete(server.url).status_code == 200
            kids = server.children()
            assert len(kids) >= 2  # scheduler + worker
            assert server.stop(sig) == 0, server.log_tail()
            time.sleep(0.5)
            assert [pid for pid in kids if alive(pid)] == []


def test_startup_log_reports_capacity(tiny_llama, tmp_path):
    with Server(tiny_llama, *TINY_ARGS, log_path=tmp_path / "log") as server:
        log = server.log_tail(20000)
    assert "architecture LlamaForCausalLM" in log and "dtype float32" in log and "device cpu" in log
    assert "KV cache (float32):" in log and "maximum concurrency at max_model_len 512" in log


def stream_in_background(url: str) -> tuple[threading.Thread, dict]:
    """Start a long streaming completion in a thread; the dict gets its status, body or exception, and done_at, and
    its "streaming" event is set once the first chunk arrived (or the request failed)."""
    outcome: dict = {"streaming": threading.Event()}

    def stream():
        try:
            with requests.post(
                f"{url}/v1/completions",
                stream=True,
                timeout=30,
                json={
                    "model": "tiny",
                    "prompt": "Once upon a time",
                    "max_tokens": 400,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as r:
                outcome["status"] = r.status_code
                chunks = []
                for chunk in r.iter_content(None):
                    chunks.append(chunk)
                    outcome["streaming"].set()
                outcome["body"] = b"".join(chunks).decode(errors="replace")
        except requests.RequestException as exc:
            outcome["exception"] = repr(exc)
        outcome["done_at"] = time.monotonic()
        outcome["streaming"].set()

    thread = threading.Thread(target=stream)
    thread.start()
    return thread, outcome


def saw_health_503(server: Server, within_s: float) -> bool:
    """Poll /health until it answers 503 (True) or the server goes away or time runs out."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            if requests.get(server.url + "/health", timeout=2).status_code == 503:
                return True
        except requests.RequestException:
            return False  # already shutting down
        time.sleep(0.1)
    return False


def assert_failed_fast(
    server: Server,
    thread: threading.Thread,
    outcome: dict,
    failed_at: float,
    saw_503: bool,
    kids: list[int],
    within_s: float = 10,
) -> None:
    thread.join(within_s + 5)
    assert not thread.is_alive(), "the in-flight request hung"
    assert outcome["done_at"] - failed_at < within_s
    assert "exception" in outcome or '"error"' in outcome.get("body", "") or outcome.get("status", 200) >= 500
    assert saw_503 or server.proc.poll() is not None
    assert server.proc.wait(15) != 0, "the instance must exit non-zero when a child dies"
    time.sleep(0.5)
    assert [pid for pid in kids if alive(pid)] == [], "orphan processes left behind"


@pytest.mark.parametrize("victim", ["scheduler", "worker0"])
def test_killed_child_makes_health_503_and_fails_requests_fast(tiny_llama, tmp_path, victim):
    server = Server(tiny_llama, "--served-model-name", "tiny", *TINY_ARGS, log_path=tmp_path / "log").start()
    try:
        kids = server.children()
        victim_pid = child_by_role(server, victim)
        thread, outcome = stream_in_background(server.url)  # a long streaming request in flight when the child dies
        # killed as soon as tokens flow: 400 tokens of the tiny model can take well under a second
        assert outcome["streaming"].wait(30) and "done_at" not in outcome
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert_failed_fast(server, thread, outcome, killed_at, saw_health_503(server, 5), kids)
    finally:
        server.stop()


def test_a_worker_that_stops_answering_is_dead_after_the_step_timeout(tiny_llama, tmp_path):
    timeout_s = 2
    server = Server(
        tiny_llama,
        "--served-model-name",
        "tiny",
        *TINY_ARGS,
        "--worker-step-timeout",
        str(timeout_s),
        log_path=tmp_path / "log",
    ).start()
    worker = child_by_role(server, "worker0")
    try:
        kids = server.children()
        assert complete(server.url, max_tokens=20).status_code == 200  # past the first steps' longer watchdog
        os.kill(worker, signal.SIGSTOP)  # alive, but never answers again
        stopped_at = time.monotonic()
        thread, outcome = stream_in_background(server.url)  # its first step never comes back
        saw_503 = saw_health_503(server, timeout_s + 5)
        assert_failed_fast(server, thread, outcome, stopped_at, saw_503, kids, within_s=timeout_s + 8)
        assert "--worker-step-timeout" in server.log_tail(20000)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGCONT)
        server.stop()


def test_killing_the_frontend_takes_the_children_down(tiny_llama, tmp_path):
    server = Server(tiny_llama, *TINY_ARGS, log_path=tmp_path / "log").start()
    kids = server.children()
    server.proc.kill()
    server.proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in kids):
        time.sleep(0.2)
    assert [pid for pid in kids if alive(pid)] == []


def test_two_instances_side_by_side(tiny_checkpoints, tmp_path):
    a = Server(str(tiny_checkpoints("llama")), "--served-model-name", "tiny", *TINY_ARGS, log_path=tmp_path / "a.log")
    b = Server(
        str(tiny_checkpoints("qwen2")),
        "--served-model-name",
        "tiny",
        *TINY_ARGS,
        log_path=tmp_path / "b.log",
        env={"TOKENMILL_LOG_IPC": "1"},
    )
    with a, b:
        ra, rb = complete(a.url), complete(b.url)
        assert ra.status_code == rb.status_code == 200
        ipc_line = [line for line in b.log_tail(20000).splitlines() if "sockets in" in line][0]
        ipc_dir = ipc_line.rsplit(" ", 1)[-1]
        mode = stat.S_IMODE(os.stat(ipc_dir).st_mode)
        assert mode == 0o700
    assert not os.path.exists(ipc_dir), "the socket directory is removed at shutdown"


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_missing_path_is_one_clear_sentence():
    result = run_cli("/nonexistent/model-dir")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "does not exist" in result.stderr.strip().splitlines()[-1]


def test_unreachable_hub_is_one_clear_sentence(tmp_path):
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
    result = run_cli("some-org/some-model", env=env)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "Could not fetch model 'some-org/some-model'" in last and "127.0.0.1:9" in last
