"""The frontend's handle on the engine: sends requests and aborts to the scheduler, routes outputs back per request.

One background task reads the scheduler's per-step `StepOutputs` and puts each `RequestOutput` on its request's queue;
another watches the child processes. When a child dies, every in-flight request ends with `EngineDeadError`, health
turns false and new requests fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.frontend.engine_protocol import ReplicaStats
from tokenmill.messages import (
    AbortRequest,
    EngineReady,
    EngineRequest,
    Ping,
    Pong,
    RequestOutput,
    SchedulerMessage,
    SchedulerStats,
    StepOutputs,
    StepSummary,
    WatchSteps,
    choice_requests,
    decoder,
    encode,
)
from tokenmill.processes import decode_or_drop, make_socket
from tokenmill.stats import sum_counters

log = logging.getLogger("tokenmill.engine_client")

HEALTH_PING_TIMEOUT_S = 5.0
CHILD_WATCH_INTERVAL_S = 0.2


class EngineDeadError(RuntimeError):
    """The scheduler or a worker process has died; the instance is going down."""


class AsyncEngineClient:
    """The `EngineClient` of one engine: connects to the scheduler's sockets in `config.ipc_dir`. `dead_child`
    reports a dead process, if any."""

    def __init__(self, config: EngineConfig, dead_child: Callable[[], str | None] = lambda: None) -> None:
        self.config = config
        self._dead_child = dead_child
        self._ctx = zmq.asyncio.Context()
        self._to_scheduler = make_socket(self._ctx, zmq.PUSH, config.ipc_address("requests"), bind=False)
        self._from_scheduler = make_socket(self._ctx, zmq.PULL, config.ipc_address("outputs"), bind=False)
        self._decoder = decoder(SchedulerMessage)
        self._queues: dict[str, asyncio.Queue] = {}
        self._pongs: dict[int, asyncio.Future] = {}
        self._nonces = itertools.count()
        self._ready: asyncio.Future[EngineReady] | None = None
        self._tasks: list[asyncio.Task] = []
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        # The latest scheduler stats; its counter fields (COUNTER_FIELDS) are running totals since start-up.
        self.latest_stats: SchedulerStats | None = None
        # gets every StepSummary the scheduler sends (after `watch_steps`): the dashboard's feed
        self.summary_listener: Callable[[StepSummary], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._tasks = [loop.create_task(self._read_outputs()), loop.create_task(self._watch_children())]

    async def wait_ready(self, timeout: float | None = None) -> EngineReady:
        """Wait for the scheduler's EngineReady (weights loaded, KV cache allocated); raise if a child dies first."""
        assert self._ready is not None, "call start() first"
        self.ready = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        return self.ready

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.mark_dead("the engine was shut down")
        self._ctx.destroy(linger=0)

    def mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        error = EngineDeadError(f"The engine stopped: {reason}.")
        for queue in self._queues.values():
            queue.put_nowait(error)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        for pong in self._pongs.values():
            if not pong.done():
                pong.set_exception(error)

    async def _watch_children(self) -> None:
        while self.dead_reason is None:
            reason = self._dead_child()
            if reason is not None:
                log.error("engine process died: %s", reason)
                self.mark_dead(reason)
                return
            await asyncio.sleep(CHILD_WATCH_INTERVAL_S)

    async def _read_outputs(self) -> None:
        while True:
            msg = decode_or_drop(self._decoder, await self._from_scheduler.recv(), log, "the scheduler")
            if isinstance(msg, StepOutputs):
                for out in msg.outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                if msg.stats is not None:
                    self._accumulate(msg.stats)
            elif isinstance(msg, Pong):
                pong = self._pongs.pop(msg.nonce, None)
                if pong is not None and not pong.done():
                    pong.set_result(msg)
            elif isinstance(msg, StepSummary):
                if self.summary_listener is not None:
                    try:
                        self.summary_listener(msg)
                    except Exception:  # the dashboard's trouble must never stop the outputs
                        log.exception("the step-summary listener failed")
            elif isinstance(msg, EngineReady) and self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)

    def _accumulate(self, stats: SchedulerStats) -> None:
        reports = [stats] if self.latest_stats is None else [self.latest_stats, stats]
        self.latest_stats = sum_counters(reports, gauges=stats)

    # ------------------------------------------------------------------ requests

    @contextlib.asynccontextmanager
    async def generate_choices(self, request: EngineRequest) -> AsyncIterator[list[AsyncIterator[RequestOutput]]]:
        """Send the request once (one message for its n choices) and give one output stream per choice, in choice
        order; each stream's last output has `finish_reason` set. On leaving, every choice the engine has not
        finished (client gone, stop string found, error) is aborted."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"The engine stopped: {self.dead_reason}.")
        request_ids = [choice.request_id for choice in choice_requests(request)]
        queues = {request_id: asyncio.Queue() for request_id in request_ids}
        self._queues.update(queues)  # before sending: no output may arrive unrouted
        finished: set[str] = set()
        try:
            await self._to_scheduler.send(encode(request))
            yield [self._outputs(queues[request_id], request_id, finished) for request_id in request_ids]
        finally:
            for request_id in request_ids:
                self._queues.pop(request_id, None)
            unfinished = [request_id for request_id in request_ids if request_id not in finished]
            if unfinished and self.dead_reason is None:
                await self._send_abort(unfinished)

    @staticmethod
    async def _outputs(queue: asyncio.Queue, request_id: str, finished: set[str]) -> AsyncIterator[RequestOutput]:
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finish_reason is not None:
                finished.add(request_id)
            yield item
            if item.finish_reason is not None:
                return

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The outputs of a one-choice request step by step; aborted if the caller stops iterating early."""
        async with self.generate_choices(request) as (outputs,):
            async for output in outputs:
                yield output

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests (idempotent: unknown or finished ids are ignored by the scheduler)."""
        if self.dead_reason is None:
            await self._send_abort(request_ids)

    def request_ids_in_flight(self) -> list[str]:
        """The engine request ids (one per choice) whose outputs someone is waiting for: a drain aborts these."""
        return list(self._queues)

    async def watch_steps(self, interval_s: float) -> None:
        """Ask the scheduler for a StepSummary at most every `interval_s` (to `summary_listener`); 0 stops them."""
        if self.dead_reason is None:
            await self._to_scheduler.send(encode(WatchSteps(interval_s)))

    async def _send_abort(self, request_ids: list[str]) -> None:
        await self._to_scheduler.send(encode(AbortRequest(list(request_ids))))

    async def check_health(self) -> bool:
        """True when the engine is ready, every child is alive and the scheduler answers a ping."""
        if self.ready is None or self.dead_reason is not None or self._dead_child() is not None:
            return False
        nonce = next(self._nonces)
        pong = asyncio.get_running_loop().create_future()
        self._pongs[nonce] = pong
        try:
            await self._to_scheduler.send(encode(Ping(nonce)))
            await asyncio.wait_for(pong, HEALTH_PING_TIMEOUT_S)
            return True
        except (asyncio.TimeoutError, EngineDeadError):
            return False
        finally:
            self._pongs.pop(nonce, None)

    def health_detail(self) -> dict[str, Any] | None:
        return None  # one engine: healthy or not, nothing in between

    def replica_stats(self) -> list[ReplicaStats] | None:
        return None

    def routing_decisions(self) -> dict[str, list[int]]:
        return {}
