"""An engine client that survives its engine (`--restart-on-failure`): a dead or hung engine is replaced by a fresh one
and every request in flight goes on where it stopped, so a client sees a pause, not an error.

It offers AsyncEngineClient's interface over the engine of the moment (an `EngineHandle`: a client and a way to stop
its processes). Every choice in flight is a `Flight`: its engine request, the tokens delivered so far and the queue
its consumer reads. Outputs are forwarded from the current engine into the flights, so when the engine dies the
consumers see nothing but a pause: the supervisor stops the old processes, launches new ones (`launch`, given by
tokenmill/serve.py, which owns process start-up), and re-sends every unfinished choice with the tokens it had already
streamed as `resumed_output_token_ids`. The new scheduler treats them as a recompute preemption would, so greedy and
seeded choices continue with exactly the tokens the old engine would have produced, and nothing is sent twice.

Bounded: after `max_restarts` restarts within `window_s` the next failure is final, as without restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenmill.frontend.engine_client import AsyncEngineClient, EngineDeadError
from tokenmill.frontend.engine_protocol import ReplicaStats
from tokenmill.frontend.lifecycle import ServerLifecycle
from tokenmill.messages import EngineReady, EngineRequest, RequestOutput, SchedulerStats, StepSummary, choice_requests

log = logging.getLogger("tokenmill.restarts")

DEATH_POLL_S = 0.05


@dataclass
class EngineHandle:
    """One engine: the frontend's client to it and a (blocking) function that stops its processes."""

    client: AsyncEngineClient
    stop: Callable[[], None]


@dataclass
class Flight:
    """One choice in flight: what it asked, what its consumer has received, where its outputs go."""

    request: EngineRequest  # the choice as the scheduler runs it (n = 1, its own id and seed)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)  # every token forwarded to the consumer, across engines
    finished: bool = False
    pump: asyncio.Task | None = None  # the task forwarding its outputs from the current engine

    def resumed(self) -> EngineRequest:
        """The request to send a fresh engine: the same choice, carrying on after the tokens already delivered
        (whose first output carried the prompt logprobs, if asked: they are not asked for twice)."""
        sampling = self.request.sampling
        if self.token_ids and sampling.prompt_logprobs is not None:
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        return msgspec.structs.replace(self.request, sampling=sampling, resumed_output_token_ids=list(self.token_ids))


class RestartingEngineClient:
    def __init__(
        self,
        first: EngineHandle,
        launch: Callable[[], EngineHandle],
        lifecycle: ServerLifecycle,
        max_restarts: int,
        window_s: float,
    ) -> None:
        """`launch` starts a fresh engine's processes and its (started) client, from within the event loop."""
        self.engine = first
        self.config = first.client.config
        self._launch = launch
        self._lifecycle = lifecycle
        self._max_restarts = max_restarts
        self._window_s = window_s
        self._restarts: deque[float] = deque()  # when each restart began (time.monotonic())
        self._flights: dict[str, Flight] = {}
        self._pumps: set[asyncio.Task] = set()
        self._supervisor: asyncio.Task | None = None
        self._restarting = False
        self._summary_listener: Callable[[StepSummary], None] | None = None
        self._watch_interval_s = 0.0  # the dashboard's last WatchSteps interval (0: not watching)
        self.dead_reason: str | None = None
        self.ready: EngineReady | None = None
        self.last_restart_s: float | None = None  # how long the last restart took, death noticed to engine ready

    # ------------------------------------------------------------------ the engine of the moment

    def start(self) -> None:
        self.engine.client.start()

    async def wait_ready(self, timeout: float | None = None) -> EngineReady:
        """The first engine's EngineReady; from then on a failed engine is replaced (one failing while it first
        loads is not: that is a configuration problem, and the instance exits)."""
        self.ready = await self.engine.client.wait_ready(timeout)
        if self._supervisor is None:
            self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        return self.ready

    def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        for pump in self._pumps:
            pump.cancel()
        self.engine.client.close()
        self.engine.stop()
        self._fail_flights(self.dead_reason or "the engine was shut down")

    @property
    def latest_stats(self) -> SchedulerStats | None:
        return self.engine.client.latest_stats

    @property
    def summary_listener(self) -> Callable[[StepSummary], None] | None:
        return self._summary_listener

    @summary_listener.setter
    def summary_listener(self, listener: Callable[[StepSummary], None] | None) -> None:
        self._summary_listener = listener
        self.engine.client.summary_listener = listener

    async def watch_steps(self, interval_s: float) -> None:
        self._watch_interval_s = interval_s  # a fresh engine is asked again
        if not self._restarting:
            await self.engine.client.watch_steps(interval_s)

    async def check_health(self) -> bool:
        return not self._restarting and self.dead_reason is None and await self.engine.client.check_health()

    def health_detail(self) -> dict[str, Any] | None:
        return None  # one engine: nothing to add to a 200

    def replica_stats(self) -> list[ReplicaStats] | None:
        return None

    def routing_decisions(self) -> dict[str, list[int]]:
        return {}

    # ------------------------------------------------------------------ requests

    @contextlib.asynccontextmanager
    async def generate_choices(self, request: EngineRequest) -> AsyncIterator[list[AsyncIterator[RequestOutput]]]:
        """As AsyncEngineClient.generate_choices; the streams outlive an engine failure."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"The engine stopped: {self.dead_reason}.")
        flights = [Flight(choice) for choice in choice_requests(request)]
        for flight in flights:
            self._flights[flight.request.request_id] = flight
        if not self._restarting:  # else the restart sends them
            self._start_pump(request, flights)
        try:
            yield [self._outputs(flight) for flight in flights]
        finally:
            for flight in flights:
                self._flights.pop(flight.request.request_id, None)
                if flight.pump is not None:
                    flight.pump.cancel()  # its engine context aborts the choice if it has not finished

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        async with self.generate_choices(request) as (outputs,):
            async for output in outputs:
                yield output

    async def abort(self, request_ids: list[str]) -> None:
        if not self._restarting and self.dead_reason is None:
            await self.engine.client.abort(request_ids)
        for request_id in request_ids:  # a choice aborted while the engine restarts is not resumed
            flight = self._flights.get(request_id)
            if flight is not None and self._restarting:
                flight.finished = True
                flight.queue.put_nowait(RequestOutput(request_id, [], "abort"))

    def request_ids_in_flight(self) -> list[str]:
        return [request_id for request_id, flight in self._flights.items() if not flight.finished]

    @staticmethod
    async def _outputs(flight: Flight) -> AsyncIterator[RequestOutput]:
        while True:
            item = await flight.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def _start_pump(self, request: EngineRequest, flights: list[Flight]) -> None:
        pump = asyncio.get_running_loop().create_task(self._pump(self.engine.client, request, flights))
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)
        for flight in flights:
            flight.pump = pump

    async def _pump(self, client: AsyncEngineClient, request: EngineRequest, flights: list[Flight]) -> None:
        """Forward one engine request's outputs to its flights; an engine failure ends it quietly (the supervisor
        resumes the flights)."""
        try:
            async with client.generate_choices(request) as streams:
                await asyncio.gather(
                    *(self._forward(stream, flight) for stream, flight in zip(streams, flights, strict=True))
                )
        except EngineDeadError:
            pass
        except Exception as exc:  # anything else is the request's own failure: its consumers must hear of it
            for flight in flights:
                if not flight.finished:
                    flight.finished = True
                    flight.queue.put_nowait(exc)

    @staticmethod
    async def _forward(stream: AsyncIterator[RequestOutput], flight: Flight) -> None:
        async for out in stream:
            flight.token_ids.extend(out.new_token_ids)
            flight.finished = out.finish_reason is not None
            flight.queue.put_nowait(out)

    # ------------------------------------------------------------------ failure and restart

    async def _supervise(self) -> None:
        """Wait for the engine to fail, then replace it while the restart budget lasts; after that, fail for good."""
        try:
            while True:
                while self.engine.client.dead_reason is None:
                    await asyncio.sleep(DEATH_POLL_S)
                reason = self.engine.client.dead_reason
                if not self._may_restart():
                    log.error(
                        "the engine failed (%s) and the %d restarts allowed within %g s are used up: giving up",
                        reason,
                        self._max_restarts,
                        self._window_s,
                    )
                    self._give_up(reason)
                    return
                await self._restart(reason)
        except Exception as exc:  # e.g. processes that cannot be started: the instance must not wait forever
            log.exception("restarting the engine failed")
            self._give_up(f"restarting the engine failed: {exc}")

    def _give_up(self, reason: str) -> None:
        self.dead_reason = reason
        self._fail_flights(reason)

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self._window_s:
            self._restarts.popleft()
        return len(self._restarts) < self._max_restarts

    async def _restart(self, reason: str) -> None:
        """Replace the engine (retrying while a fresh one fails to start, within the budget) and resume the flights."""
        began = time.monotonic()
        self._restarts.append(began)
        self._restarting = True
        if self._lifecycle.phase == "ready":
            self._lifecycle.phase = "degraded"
        log.error(
            "the engine failed (%s): restarting it (%d of at most %d within %g s); %d requests wait",
            reason,
            len(self._restarts),
            self._max_restarts,
            self._window_s,
            len(self.request_ids_in_flight()),
        )
        old = self.engine
        old.client.close()
        await asyncio.to_thread(old.stop)
        stopped = time.monotonic()
        try:
            self.engine = self._launch()
            self.engine.client.summary_listener = self._summary_listener
            self.ready = await self.engine.client.wait_ready()
        except EngineDeadError:
            return  # the supervisor sees the new engine dead and tries again while the budget lasts
        self.last_restart_s = time.monotonic() - began
        self._restarting = False
        if self._lifecycle.phase == "degraded":
            self._lifecycle.phase = "ready"
        self._resume_flights()
        if self._watch_interval_s:
            await self.engine.client.watch_steps(self._watch_interval_s)
        log.warning(
            "engine restarted in %.2f s (old engine stopped in %.2f s, the fresh one loaded in %.2f s); %d "
            "requests resumed",
            self.last_restart_s,
            stopped - began,
            self.last_restart_s - (stopped - began),
            len(self.request_ids_in_flight()),
        )

    def _resume_flights(self) -> None:
        for flight in list(self._flights.values()):
            if flight.finished:
                continue
            if flight.token_ids and flight.request.sampling.structured_outputs is not None:
                # its grammar state is not carried over: end it honestly rather than let it break its constraint
                flight.finished = True
                flight.queue.put_nowait(
                    EngineDeadError("The engine failed and a structured-output request cannot resume mid-output.")
                )
                continue
            self._start_pump(flight.resumed(), [flight])

    def _fail_flights(self, reason: str) -> None:
        for flight in self._flights.values():
            if not flight.finished:
                flight.finished = True
                flight.queue.put_nowait(EngineDeadError(f"The engine stopped: {reason}."))
