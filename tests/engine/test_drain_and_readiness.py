"""Operations against a real server: the port opens while loading, readiness tells loading / ready / draining apart,
and SIGTERM drains the requests in flight (all finish inside --shutdown-timeout, or end cleanly with "abort")."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import requests

from tests.helpers.server import Server, alive
from tests.helpers.stream_client import start_streams

pytestmark = pytest.mark.slow

TINY_ARGS = ("--served-model-name", "tiny", "--kv-cache-memory-bytes", "64MiB", "--max-model-len", "1024")


@pytest.fixture
def tiny_llama(tiny_checkpoints) -> str:
    return str(tiny_checkpoints("llama"))


def launch(server: Server) -> requests.Response:
    """Start the server process without waiting for it to be ready; the first answer of its /ready."""
    with open(server.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        server.proc = subprocess.Popen(server.args, stdout=log, stderr=subprocess.STDOUT, env=server.env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            return requests.get(server.url + "/ready", timeout=2)
        except requests.ConnectionError:
            time.sleep(0.05)
    raise AssertionError(f"the port never opened (exit code {server.proc.poll()}): {server.log_tail()}")


def wait_ready(server: Server, within_s: float = 120) -> requests.Response:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        response = requests.get(server.url + "/ready", timeout=5)
        if response.status_code == 200:
            return response
        time.sleep(0.2)
    raise AssertionError(f"never ready: {server.log_tail()}")


def stream_bodies(count: int, max_tokens: int) -> list[dict]:
    return [
        {
            "model": "tiny",
            "prompt": f"Story number {i}:",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(count)
    ]


def test_port_opens_while_loading_and_readiness_follows_the_engine(tiny_llama, tmp_path):
    server = Server(tiny_llama, *TINY_ARGS, log_path=tmp_path / "log")
    try:
        first = launch(server)
        assert first.status_code == 503 and first.json() == {"status": "loading"}
        models = requests.get(server.url + "/v1/models", timeout=5)
        if models.status_code == 503:  # still loading (it usually is): a clear message and a retry hint
            assert "loading" in models.json()["error"]["message"] and models.headers["Retry-After"]
        assert wait_ready(server).json() == {"status": "ready"}
        assert requests.get(server.url + "/health", timeout=5).status_code == 200
        assert requests.get(server.url + "/ping", timeout=5).status_code == 200
        assert requests.post(server.url + "/ping", timeout=5).status_code == 200
        load = requests.get(server.url + "/load", timeout=5).json()
        assert set(load) == {"server_load", "num_running", "num_waiting", "kv_cache_usage"}
        assert load["server_load"] == 0 and load["num_running"] == 0
        assert requests.get(server.url + "/v1/models", timeout=5).status_code == 200
    finally:
        assert server.stop() == 0, server.log_tail()


def drain_with_streams(server: Server, max_tokens: int) -> tuple[list, float, list[int]]:
    """Start 8 streams, SIGTERM once every one has output, check the server refuses new work while it drains; the
    streams' records, when the signal went, and the engine processes' pids."""
    wait_ready(server)
    kids = server.children()
    threads, records = start_streams(server.url, stream_bodies(8, max_tokens))
    assert all(record.first_chunk.wait(60) for record in records)
    signalled_at = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # the signal is handled on the server's event loop
    ready = requests.get(server.url + "/ready", timeout=5)
    refused = requests.post(server.url + "/v1/completions", timeout=5, json=stream_bodies(1, 4)[0])
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) > 0
    assert "shutting down" in refused.json()["error"]["message"]
    for thread in threads:
        thread.join(150)
    return records, signalled_at, kids


def assert_exited_cleanly(server: Server, kids: list[int]) -> None:
    assert server.proc.wait(60) == 0, server.log_tail()
    time.sleep(0.5)
    assert [pid for pid in kids if alive(pid)] == []


def test_sigterm_lets_streams_in_flight_finish(tiny_llama, tmp_path):
    # long enough streams that the server is still draining when the test asks (64 tokens each could all end within
    # the 0.2 s it waits after the signal, and the port with them), and a generous timeout: on a host shared by many
    # jobs 8 streams of 600 tokens can take tens of seconds
    server = Server(tiny_llama, *TINY_ARGS, "--shutdown-timeout", "120", log_path=tmp_path / "log")
    try:
        launch(server)
        records, _, kids = drain_with_streams(server, max_tokens=600)
        for record in records:
            assert record.error is None and record.status == 200
            assert record.done and record.finish_reason == "length" and record.completion_tokens == 600
        assert_exited_cleanly(server, kids)
    finally:
        server.stop(signal.SIGKILL)


def test_sigterm_past_the_shutdown_timeout_ends_streams_with_abort(tiny_llama, tmp_path):
    server = Server(tiny_llama, *TINY_ARGS, "--shutdown-timeout", "1", log_path=tmp_path / "log")
    try:
        launch(server)
        records, signalled_at, kids = drain_with_streams(server, max_tokens=1000)
        for record in records:
            assert record.error is None and record.status == 200
            assert record.done and record.finish_reason == "abort"
            assert 0 < record.completion_tokens < 1000
            assert record.chunk_times[-1] - signalled_at < 1 + 5  # the timeout, then the aborts' last chunks
        assert_exited_cleanly(server, kids)
    finally:
        server.stop(signal.SIGKILL)
