"""The dashboard's feed from the scheduler: every step condensed into a ring, and a `StepSummary` of the queues and the
block pool built at most every `interval_s` while someone watches (the frontend sends `WatchSteps` when a dashboard or
/debug/steps stream connects, and `WatchSteps(0)` when the last one goes).

What it costs the hot path:
- `record` runs after every step, watched or not: one pass over the plan's requests to split its tokens into prefill
  and decode, and a tuple appended to a ring (a few microseconds at batch 32), so a dashboard that connects late still
  sees the last `HISTORY_STEPS` steps;
- `maybe_publish` builds and sends a summary only while watched and due: a copy of the pool's one-byte-per-block
  state (kept by `BlockPool` as blocks move), the running requests' blocks colored over it, and one queue entry per
  request (capped). It throttles itself: after a summary that took t of CPU time, the next waits at least
  t / MAX_DUTY (up to MAX_BACKOFF_S), so summaries never take more than MAX_DUTY of the loop's time, whatever the pool
  or queue sizes. CPU time, not wall time: a loop the OS descheduled mid-summary is not what the summary cost.
`scripts/bench_dashboard.py` measures both against the engine's own step timing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.messages import QueueEntry, StepPlan, StepRecord, StepSummary
from tokenmill.scheduler.block_pool import BLOCK_CACHED

if TYPE_CHECKING:  # the scheduler never imports this module; the type is only for the signatures
    from tokenmill.scheduler.scheduler import Scheduler

HISTORY_STEPS = 512  # the steps a summary can carry: the ring's length, and the most one summary holds
MAX_QUEUE_ENTRIES = 256  # requests listed per summary (running first); the counts cover the rest
MAX_DUTY = 0.005  # the most of the scheduler loop's time summaries may take
MAX_BACKOFF_S = 1.0  # however long one took, the next summary comes within this
# block_map codes: 0 free, 1 cached (BlockPool.state), 2 in use by a request past the cap, then one per request
FIRST_COLOR = 3
NUM_COLORS = 256 - FIRST_COLOR


def split_tokens(plan: StepPlan) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of a plan. A request the workers already hold that sampled last step decodes
    one token; everything else (new or resumed requests, later chunks of a prompt) is prefill."""
    prefill = decode = 0
    for new in plan.new_requests:
        prefill += new.num_scheduled_tokens
    for running in plan.running:
        if running.new_token_ids:
            decode += running.num_scheduled_tokens
        else:
            prefill += running.num_scheduled_tokens
    return prefill, decode


def request_color(arrival_seq: int) -> int:
    """A request's code in the block map: stable for its life, different for consecutive arrivals."""
    return FIRST_COLOR + arrival_seq % NUM_COLORS


class StepSummarizer:
    """Owned by the scheduler loop: `record` every step, `maybe_publish` after it (and while idle)."""

    def __init__(
        self,
        send: Callable[[StepSummary], None],
        engine_index: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self.send = send
        self.engine_index = engine_index
        self.clock = clock
        self.cpu_clock = cpu_clock
        self.wall_clock = wall_clock
        self.history: deque[StepRecord] = deque(maxlen=HISTORY_STEPS)
        self.pending: deque[StepRecord] | None = None  # steps since the last summary, while watched
        self.interval_s = 0.0
        self.next_due = 0.0
        self.last_step_id = -1
        self.preemptions_seen = 0
        self.summary_time_s = 0.0  # CPU time building and sending summaries, since start-up
        self.num_summaries = 0

    @property
    def watched(self) -> bool:
        return self.interval_s > 0

    def watch(self, interval_s: float) -> None:
        """Start (interval > 0) or stop (0) publishing. A new watcher first gets the ring's history."""
        if interval_s > 0 and not self.watched:
            self.pending = deque(self.history, maxlen=HISTORY_STEPS)
            self.next_due = 0.0
        elif interval_s <= 0:
            self.pending = None
        self.interval_s = max(interval_s, 0.0)

    def record(self, plan: StepPlan, step_time_s: float, preemptions_total: int) -> None:
        """One finished step; `preemptions_total` is the scheduler's count since start-up."""
        prefill, decode = split_tokens(plan)
        record = (
            plan.step_id,
            prefill,
            decode,
            len(plan.new_requests) + len(plan.running),
            step_time_s,
            preemptions_total - self.preemptions_seen,
        )
        self.preemptions_seen = preemptions_total
        self.last_step_id = plan.step_id
        self.history.append(record)
        if self.pending is not None:
            self.pending.append(record)

    def maybe_publish(self, scheduler: Scheduler) -> bool:
        """Build and send a summary of `scheduler` if one is watched and due. Returns whether it sent one."""
        if not self.watched:
            return False
        now = self.clock()
        if now < self.next_due:
            return False
        cpu_start = self.cpu_clock()
        self.send(self.build(scheduler))
        cost = self.cpu_clock() - cpu_start
        self.summary_time_s += cost
        self.num_summaries += 1
        self.next_due = now + min(max(self.interval_s, cost / MAX_DUTY), MAX_BACKOFF_S)
        return True

    def build(self, scheduler: Scheduler) -> StepSummary:
        """The summary of the scheduler's state now, with the steps recorded since the previous one."""
        kv = scheduler.kv
        pool = kv.pool
        block_map = bytearray(pool.state)
        req_blocks = kv.req_blocks
        queue: list[QueueEntry] = []
        for req in scheduler.running[:MAX_QUEUE_ENTRIES]:
            color = request_color(req.arrival_seq)
            for block in req_blocks.get(req.request_id, ()):
                block_map[block.block_id] = color
            queue.append(
                QueueEntry(
                    req.request_id,
                    True,
                    min(req.num_computed_tokens, req.num_prompt_tokens),
                    req.num_prompt_tokens,
                    req.num_output_tokens,
                    req.max_tokens,
                    req.priority,
                    req.num_preemptions,
                    color,
                )
            )
        for req in scheduler.waiting[: MAX_QUEUE_ENTRIES - len(queue)]:
            queue.append(
                QueueEntry(
                    req.request_id,
                    False,
                    min(req.num_computed_tokens, req.num_prompt_tokens),
                    req.num_prompt_tokens,
                    req.num_output_tokens,
                    req.max_tokens,
                    req.priority,
                    req.num_preemptions,
                    0,
                )
            )
        steps = list(self.pending) if self.pending is not None else []
        if self.pending is not None:
            self.pending.clear()
        queries, hits, preemptions = scheduler.counter_totals()
        return StepSummary(
            engine=self.engine_index,
            step_id=self.last_step_id,
            time=self.wall_clock(),
            steps=steps,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            queue=queue,
            num_blocks=pool.num_blocks,
            block_size=kv.block_size,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.state.count(BLOCK_CACHED),
            block_map=bytes(block_map),
            kv_cache_usage=pool.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
            summary_time_s=self.summary_time_s,
        )
