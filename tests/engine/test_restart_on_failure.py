"""--restart-on-failure against a real server: a worker killed with SIGKILL while 16 streams run is replaced, and every
stream completes with exactly the text of an undisturbed run (greedy and seeded alike), no token lost or repeated."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import requests

from tests.helpers.server import Server
from tests.helpers.stream_client import StreamRecord, start_streams

pytestmark = pytest.mark.slow

TINY_ARGS = ("--served-model-name", "tiny", "--kv-cache-memory-bytes", "64MiB", "--max-model-len", "1024")
MAX_TOKENS = 160


def worker_pid(server: Server) -> int:
    for pid in server.children():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "tm-worker0":
                return pid
        except OSError:
            continue
    raise AssertionError("no worker process")


def bodies() -> list[dict]:
    """8 greedy and 8 seeded sampled streams."""
    greedy = [{"prompt": f"Story number {i}:", "temperature": 0} for i in range(8)]
    seeded = [{"prompt": f"Poem number {i}:", "temperature": 0.9, "seed": 100 + i} for i in range(8)]
    return [{"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True, **body} for body in greedy + seeded]


def run_all(url: str) -> list[StreamRecord]:
    threads, records = start_streams(url, bodies())
    for thread in threads:
        thread.join(180)
    return records


def resumed_at(record: StreamRecord, killed_at: float) -> float:
    """When the stream's longest pause after the kill ended: its first token from the fresh engine."""
    gaps = [(later - earlier, later) for earlier, later in itertools.pairwise(record.chunk_times) if later > killed_at]
    return max(gaps)[1]


def readiness_during(url: str, records: list[StreamRecord], within_s: float) -> set[str]:
    """Every /ready status seen until the streams are done."""
    seen: set[str] = set()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not all(record.done or record.error for record in records):
        seen.add(requests.get(url + "/ready", timeout=5).json()["status"])
        time.sleep(0.05)
    return seen


def test_a_killed_worker_is_replaced_and_every_stream_completes(tiny_checkpoints, tmp_path):
    with Server(
        str(tiny_checkpoints("llama")), *TINY_ARGS, "--restart-on-failure", log_path=tmp_path / "log"
    ) as server:
        undisturbed = run_all(server.url)
        assert all(r.done and r.completion_tokens == MAX_TOKENS for r in undisturbed)
        old_worker = worker_pid(server)
        threads, records = start_streams(server.url, bodies())
        assert all(record.first_chunk.wait(60) for record in records)
        os.kill(old_worker, signal.SIGKILL)
        killed_at = time.monotonic()
        seen = readiness_during(server.url, records, 120)
        for thread in threads:
            thread.join(120)
        for before, after in zip(undisturbed, records, strict=True):
            assert after.error is None and after.status == 200, server.log_tail()
            assert after.done and after.finish_reason == "length" and after.completion_tokens == MAX_TOKENS
            assert after.text == before.text
        assert "degraded" in seen and worker_pid(server) != old_worker
        restart_s = min(resumed_at(record, killed_at) for record in records) - killed_at
        print(f"restart time (SIGKILL of the worker to the first token from the fresh engine): {restart_s:.2f} s")
        assert "engine restarted in" in server.log_tail(50000)
        assert requests.get(server.url + "/ready", timeout=5).json() == {"status": "ready"}


def test_a_hung_worker_is_replaced_after_the_step_timeout(tiny_checkpoints, tmp_path):
    greedy = bodies()[:4]
    with Server(
        str(tiny_checkpoints("llama")),
        *TINY_ARGS,
        "--restart-on-failure",
        "--worker-step-timeout",
        "1",
        log_path=tmp_path / "log",
    ) as server:
        threads, undisturbed = start_streams(server.url, greedy)
        for thread in threads:
            thread.join(120)
        threads, records = start_streams(server.url, greedy)
        assert all(record.first_chunk.wait(60) for record in records)
        os.kill(worker_pid(server), signal.SIGSTOP)  # alive but silent: only the scheduler's watchdog can tell
        for thread in threads:
            thread.join(180)
        for before, after in zip(undisturbed, records, strict=True):
            assert after.error is None and after.done and after.text == before.text, server.log_tail()
        assert "no worker answered step" in server.log_tail(50000)
