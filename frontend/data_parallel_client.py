"""The frontend's handle on N data-parallel engine replicas, an `EngineClient` (frontend/engine_protocol.py).

Each replica has its own `AsyncEngineClient` (its sockets, its output reader, its child watcher). A request goes, with
all of its `n` choices, to the replica the router picks (`frontend/router.py`); its aborts follow it there.

A replica that dies is taken out of rotation at once: its client ends its in-flight requests with EngineDeadError
(503 over HTTP), its remaining processes are stopped, and the others keep serving; /health answers 200 with a body
saying "degraded" and naming the dead replica, and turns 503 when no replica is left. With
`--data-parallel-fail-fast` the first death stops the instance instead (as one replica's death does without DP).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.frontend.engine_client import AsyncEngineClient, EngineDeadError
from tokenmill.frontend.engine_protocol import ReplicaStats
from tokenmill.frontend.router import Router
from tokenmill.messages import EngineReady, EngineRequest, RequestOutput, SchedulerStats, StepSummary, choice_requests
from tokenmill.stats import sum_counters

log = logging.getLogger("tokenmill.data_parallel")

DEATH_WATCH_INTERVAL_S = 0.1


class DataParallelEngineClient:
    """The `EngineClient` over N replicas. `replica_configs[i]` and `dead_children[i]` describe replica i;
    `stop_replica(i)` stops its processes (it is called in a thread once the replica has died, so nothing of it
    lingers until shutdown)."""

    def __init__(
        self,
        replica_configs: Sequence[EngineConfig],
        dead_children: Sequence[Callable[[], str | None]],
        stop_replica: Callable[[int], None] | None = None,
    ) -> None:
        self.config = replica_configs[0]
        self.replicas = [
            AsyncEngineClient(config, dead_child) for config, dead_child in zip(replica_configs, dead_children)
        ]
        parallel = self.config.parallel
        self.fail_fast = parallel.data_parallel_fail_fast
        self.router = Router(len(self.replicas), self.config.cache.block_size, parallel.data_parallel_routing)
        self._stop_replica = stop_replica
        self._owner: dict[str, int] = {}  # request id of each choice in flight -> its replica
        self._dead: dict[int, str] = {}  # replica -> why it died
        self._unhealthy: dict[int, str] = {}  # replica -> why the last health check failed (alive or dead)
        self._tasks: list[asyncio.Task] = []
        self._summary_listener: Callable[[StepSummary], None] | None = None
        self.ready: EngineReady | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()
        self._tasks = [asyncio.get_running_loop().create_task(self._watch_replicas())]

    async def wait_ready(self, timeout: float | None = None) -> EngineReady:
        """Every replica's EngineReady (the first one's is returned); raises if any dies while starting."""
        readies = await asyncio.wait_for(asyncio.gather(*(r.wait_ready() for r in self.replicas)), timeout)
        for rank, ready in enumerate(readies):
            self.router.indexes[rank].max_entries = min(self.router.indexes[rank].max_entries, ready.num_kv_blocks)
        self.ready = readies[0]
        return self.ready

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for replica in self.replicas:
            replica.close()

    @property
    def dead_reason(self) -> str | None:
        """Why the instance as a whole cannot serve: no replica is left (or, failing fast, one has died)."""
        self._notice_deaths()
        if self._dead and (self.fail_fast or len(self._dead) == len(self.replicas)):
            return "; ".join(f"data-parallel replica {rank}: {reason}" for rank, reason in sorted(self._dead.items()))
        return None

    def _notice_deaths(self) -> None:
        for rank, replica in enumerate(self.replicas):
            if replica.dead_reason is not None and rank not in self._dead:
                self._on_death(rank, replica.dead_reason)

    def _on_death(self, rank: int, reason: str) -> None:
        self._dead[rank] = reason
        self.router.set_alive(rank, False)
        alive = len(self.replicas) - len(self._dead)
        log.error(
            "data-parallel replica %d died (%s); %d of %d replicas left%s",
            rank,
            reason,
            alive,
            len(self.replicas),
            " (--data-parallel-fail-fast: stopping)" if self.fail_fast and alive else "",
        )
        if self.fail_fast:
            for other in self.replicas:
                other.mark_dead(f"data-parallel replica {rank} died: {reason}")
        if self._stop_replica is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: shutting down, the launcher stops it
                asyncio.get_running_loop().run_in_executor(None, self._stop_replica, rank)

    async def _watch_replicas(self) -> None:
        while len(self._dead) < len(self.replicas):
            self._notice_deaths()
            await asyncio.sleep(DEATH_WATCH_INTERVAL_S)

    # ------------------------------------------------------------------ state the frontend reads

    @property
    def latest_stats(self) -> SchedulerStats | None:
        """The live replicas' stats combined: queues and counters summed, KV usage averaged."""
        stats = [
            r.latest_stats
            for rank, r in enumerate(self.replicas)
            if r.latest_stats is not None and rank not in self._dead
        ]
        if not stats:
            return None
        gauges = SchedulerStats(
            num_running=sum(s.num_running for s in stats),
            num_waiting=sum(s.num_waiting for s in stats),
            kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            running_lora_adapters=sorted({name for s in stats for name in s.running_lora_adapters}),
            waiting_lora_adapters=sorted({name for s in stats for name in s.waiting_lora_adapters}),
        )
        return sum_counters(stats, gauges)

    def replica_stats(self) -> list[ReplicaStats] | None:
        """Every replica, alive or not, with its latest stats: the per-engine metrics."""
        self._notice_deaths()
        return [ReplicaStats(rank, rank not in self._dead, r.latest_stats) for rank, r in enumerate(self.replicas)]

    def routing_decisions(self) -> dict[str, list[int]]:
        return self.router.decisions

    @property
    def summary_listener(self) -> Callable[[StepSummary], None] | None:
        return self._summary_listener

    @summary_listener.setter
    def summary_listener(self, listener: Callable[[StepSummary], None] | None) -> None:
        self._summary_listener = listener
        for replica in self.replicas:
            replica.summary_listener = listener

    # ------------------------------------------------------------------ requests

    def _route(self, request: EngineRequest) -> int:
        self._notice_deaths()
        if (reason := self.dead_reason) is not None:
            raise EngineDeadError(f"The engine stopped: {reason}.")
        for rank, replica in enumerate(self.replicas):
            if replica.latest_stats is not None:
                self.router.kv_usage[rank] = replica.latest_stats.kv_cache_usage
        lora_id = request.lora_request.lora_int_id if request.lora_request is not None else None
        return self.router.route(request.prompt_token_ids, request.cache_salt, request.sampling.n, lora_id)

    @contextlib.asynccontextmanager
    async def generate_choices(self, request: EngineRequest) -> AsyncIterator[list[AsyncIterator[RequestOutput]]]:
        """AsyncEngineClient.generate_choices on the replica the router picks for the request."""
        rank = self._route(request)
        request_ids = [choice.request_id for choice in choice_requests(request)]
        for request_id in request_ids:
            self._owner[request_id] = rank
        try:
            async with self.replicas[rank].generate_choices(request) as streams:
                yield streams
        finally:
            for request_id in request_ids:
                self._owner.pop(request_id, None)
            self.router.release(rank, len(request_ids))

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        async with self.generate_choices(request) as (outputs,):
            async for output in outputs:
                yield output

    async def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._owner.get(request_id)
            if rank is not None:
                by_replica.setdefault(rank, []).append(request_id)
        for rank, ids in by_replica.items():
            await self.replicas[rank].abort(ids)

    def request_ids_in_flight(self) -> list[str]:
        """Every replica's engine request ids (one per choice) still in flight: a drain aborts these."""
        return list(self._owner)

    async def watch_steps(self, interval_s: float) -> None:
        for replica in self.replicas:
            await replica.watch_steps(interval_s)

    # ------------------------------------------------------------------ health

    async def check_health(self) -> bool:
        """True while at least one replica is ready, alive and answers a ping (and, failing fast, none has died)."""
        if self.ready is None or self.dead_reason is not None:
            return False
        results = await asyncio.gather(*(r.check_health() for r in self.replicas))
        self._unhealthy = {
            rank: self._dead.get(rank) or "does not answer a health check"
            for rank, healthy in enumerate(results)
            if not healthy
        }
        return len(self._unhealthy) < len(self.replicas)

    def health_detail(self) -> dict[str, Any] | None:
        """After check_health: None when every replica is healthy, else what /health says of each."""
        if not self._unhealthy:
            return None
        return {
            "status": "degraded",
            "replicas": [
                {
                    "engine": str(rank),
                    "healthy": rank not in self._unhealthy,
                    **({"reason": self._unhealthy[rank]} if rank in self._unhealthy else {}),
                }
                for rank in range(len(self.replicas))
            ],
        }
