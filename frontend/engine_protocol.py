"""The one interface the HTTP frontend drives an engine through (as vLLM's `EngineClient`).

Implemented by the single-engine client (frontend/engine_client.py), the data-parallel client over N replicas
(frontend/data_parallel_client.py) and the tests' fake engine. Handlers, metrics and the dashboard take an
`EngineClient` and call what it declares; none of them probes an engine for optional members.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, NamedTuple, Protocol

from tokenmill.messages import EngineReady, EngineRequest, RequestOutput, SchedulerStats, StepSummary

# what generate_choices returns: entered, one output stream per choice
ChoiceStreams = AbstractAsyncContextManager[list[AsyncIterator[RequestOutput]]]


class ReplicaStats(NamedTuple):
    """One data-parallel replica as the per-engine metrics see it."""

    rank: int
    alive: bool
    stats: SchedulerStats | None  # its latest report (counters as running totals); None before the first


class EngineClient(Protocol):
    # the scheduler's EngineReady once the engine is up (weights loaded, KV cache allocated), else None
    ready: EngineReady | None
    # gets every StepSummary the scheduler sends once `watch_steps` asked for them: the dashboard's feed
    summary_listener: Callable[[StepSummary], None] | None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine can no longer serve (a process died, it was shut down); None while it can."""
        ...

    @property
    def latest_stats(self) -> SchedulerStats | None:
        """The latest queue sizes and KV usage, with every counter a running total since start-up
        (`tokenmill.stats.sum_counters`); None before the first report."""
        ...

    # ------------------------------------------------------------------ lifecycle (tokenmill/serve.py)

    def start(self) -> None:
        """Start reading outputs and watching the engine's processes (inside the running event loop)."""
        ...

    async def wait_ready(self, timeout: float | None = None) -> EngineReady:
        """The engine's EngineReady; raises if it dies first."""
        ...

    def close(self) -> None:
        """Stop reading and end every request still in flight."""
        ...

    # ------------------------------------------------------------------ requests

    def generate_choices(self, request: EngineRequest) -> ChoiceStreams:
        """Send the request once and give one output stream per choice, in choice order; every choice the engine
        has not finished when the context exits is aborted."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The outputs of a one-choice request; aborted if the caller stops iterating early."""
        ...

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored)."""
        ...

    def request_ids_in_flight(self) -> list[str]:
        """The engine request ids of every choice still in flight (a drain aborts them)."""
        ...

    async def watch_steps(self, interval_s: float) -> None:
        """Ask for a StepSummary at most every `interval_s` (to `summary_listener`); 0 stops them."""
        ...

    # ------------------------------------------------------------------ health and metrics

    async def check_health(self) -> bool:
        """True when the engine is ready, its processes alive and its scheduler answering."""
        ...

    def health_detail(self) -> dict[str, Any] | None:
        """After check_health: what /health adds to a 200 (a degraded data-parallel instance); None for nothing."""
        ...

    def replica_stats(self) -> list[ReplicaStats] | None:
        """Each data-parallel replica's stats for the per-engine metrics; None for a single engine."""
        ...

    def routing_decisions(self) -> dict[str, list[int]]:
        """Data parallel: requests sent to each replica, by the router's reason; empty for a single engine."""
        ...
