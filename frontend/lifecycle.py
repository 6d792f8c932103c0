"""Where a serving instance is in its life, and the gate every API request passes because of it.

The HTTP port opens while the engine still loads: orchestrators then see a live process whose readiness says
"loading" instead of a refused connection. `ServerLifecycle` holds the phase (loading → ready ⇄ degraded → draining)
and counts the API requests in flight, so a drain can wait for them. `lifecycle_middleware` refuses new /v1/*
requests with a 503 (and `Retry-After`) while the instance loads, drains or restarts its engine; /health, /ready,
/ping, /load, /metrics and the rest always answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

from aiohttp import web

from tokenmill.frontend.errors import APIError

Phase = Literal["loading", "ready", "degraded", "draining"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

RETRY_AFTER_S = {"loading": 5, "degraded": 2, "draining": 30}  # a client's hint: when trying again may help
REFUSALS = {
    "loading": "The model is still loading; try again shortly (GET /ready answers 200 once it serves).",
    "degraded": "The engine is restarting after a failure; try again shortly.",
    "draining": "The server is shutting down and takes no new requests.",
}


class ServerLifecycle:
    """The instance's phase and its API requests in flight (those that passed the gate and have not returned)."""

    def __init__(self, phase: Phase = "loading") -> None:
        self.phase: Phase = phase
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def admitting(self) -> bool:
        return self.phase == "ready"

    def request_started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def request_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float, cut_short: asyncio.Event | None = None) -> bool:
        """Wait until no API request is in flight, at most `timeout_s` or until `cut_short` is set; True if idle."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if cut_short is not None:
            waits.append(asyncio.ensure_future(cut_short.wait()))
        try:
            await asyncio.wait(waits, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self._idle.is_set()


def is_api_path(path: str) -> bool:
    return path.startswith("/v1/")


def make_lifecycle_middleware(
    lifecycle: ServerLifecycle,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def lifecycle_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse new API requests unless the instance serves; count the admitted ones until they return."""
        if not is_api_path(request.path) or request.method == "OPTIONS":
            return await handler(request)
        if not lifecycle.admitting:
            raise APIError(503, REFUSALS[lifecycle.phase], headers={"Retry-After": str(RETRY_AFTER_S[lifecycle.phase])})
        lifecycle.request_started()
        try:
            return await handler(request)
        finally:
            lifecycle.request_ended()

    return lifecycle_middleware
