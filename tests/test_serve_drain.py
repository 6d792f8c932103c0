"""The drain of tokenmill/serve.py over a fake engine: requests that finish in time are left alone, the rest are
aborted at the timeout, and a second signal cuts the wait short."""

from __future__ import annotations

import asyncio
import signal
import time

from tokenmill.frontend.lifecycle import ServerLifecycle
from tokenmill.serve import ShutdownSignals, drain


class FakeClient:
    """Requests in flight that end when aborted (as the scheduler's abort outputs end their streams)."""

    def __init__(self, lifecycle: ServerLifecycle, request_ids: list[str]) -> None:
        self.lifecycle = lifecycle
        self.in_flight = list(request_ids)
        self.aborted: list[str] = []
        self.dead_reason = None
        for _ in request_ids:
            lifecycle.request_started()

    def request_ids_in_flight(self) -> list[str]:
        return list(self.in_flight)

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.in_flight.remove(request_id)
            self.aborted.append(request_id)
            self.lifecycle.request_ended()


def test_requests_that_finish_in_time_are_not_aborted():
    async def run() -> None:
        lifecycle = ServerLifecycle("ready")
        client = FakeClient(lifecycle, ["a", "b"])
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lifecycle.request_ended)
        loop.call_later(0.1, lifecycle.request_ended)
        await drain(client, lifecycle, 5.0, asyncio.Event())  # type: ignore[arg-type]
        assert lifecycle.phase == "draining" and client.aborted == [] and lifecycle.in_flight == 0

    asyncio.run(run())


def test_past_the_timeout_or_on_a_second_signal_the_rest_is_aborted():
    async def run(timeout_s: float, hurry_after_s: float | None) -> float:
        lifecycle = ServerLifecycle("ready")
        signals = ShutdownSignals(asyncio.get_running_loop(), lifecycle)
        client = FakeClient(lifecycle, ["a", "b"])
        signals._received(signal.SIGTERM)
        assert lifecycle.phase == "draining" and signals.stop.is_set() and not signals.hurry.is_set()
        if hurry_after_s is not None:
            asyncio.get_running_loop().call_later(hurry_after_s, signals._received, signal.SIGTERM)
        began = time.monotonic()
        await drain(client, lifecycle, timeout_s, signals.hurry)  # type: ignore[arg-type]
        assert sorted(client.aborted) == ["a", "b"] and lifecycle.in_flight == 0
        return time.monotonic() - began

    assert 0.2 <= asyncio.run(run(0.2, None)) < 2
    assert asyncio.run(run(60.0, 0.05)) < 2  # the second signal skips the 60 s wait
