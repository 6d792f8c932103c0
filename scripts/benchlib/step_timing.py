"""Per-step timing of an offline engine run, from the `StepOutputs` messages the `LLM` object receives.

The scheduler publishes one `StepOutputs` per step that produced tokens, and attaches `SchedulerStats` (step and
model time summed since its last report) every half second and whenever a request finishes. `StepRecorder` keeps
each message's arrival time, which requests got tokens, and the stats, so a benchmark can time pure-decode steps
and per-request TPOT without touching the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.messages import SchedulerStats, StepOutputs


class WindowTooShort(ValueError):
    """The decode window held too few steps or stats reports to time: decode more tokens."""


@dataclass
class StepRecord:
    arrival_s: float
    request_ids: list[str]  # requests that got tokens this step
    num_new_tokens: int
    finished_ids: list[str]
    stats: SchedulerStats | None


@dataclass
class DecodeWindow:
    """Steps in which every one of `batch_size` requests decoded one token, and nothing else ran."""

    batch_size: int
    num_steps: int
    wall_step_time_s: float  # arrival to arrival at the client: everything a user of the engine waits for
    stats_steps: int  # steps covered by the stats reports inside the window
    step_time_s: float  # the scheduler's mean step time over those steps
    model_time_s: float  # the worker's mean forward + sampling time over those steps

    @property
    def overhead_s(self) -> float:
        """Scheduling + messaging per step, as the scheduler measures it."""
        return self.step_time_s - self.model_time_s

    @property
    def overhead_fraction(self) -> float:
        return self.overhead_s / self.step_time_s

    @property
    def loop_overhead_fraction(self) -> float:
        """Everything but the model over the client-side step time (adds publishing and the client's receive)."""
        return 1.0 - self.model_time_s / self.wall_step_time_s


@dataclass
class StepRecorder:
    records: list[StepRecord] = field(default_factory=list)

    def __call__(self, message: StepOutputs) -> None:
        outputs = [o for o in message.outputs if o.new_token_ids or o.finish_reason]
        self.records.append(
            StepRecord(
                time.perf_counter(),
                [o.request_id for o in outputs],
                sum(len(o.new_token_ids) for o in outputs),
                [o.request_id for o in outputs if o.finish_reason],
                message.stats,
            )
        )

    def tpots_s(self) -> list[float]:
        """Per request: (last token time - first token time) / (tokens - 1), for requests with 2+ tokens."""
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        count: dict[str, int] = {}
        for record in self.records:
            for request_id in record.request_ids:
                first.setdefault(request_id, record.arrival_s)
                last[request_id] = record.arrival_s
                count[request_id] = count.get(request_id, 0) + 1
        return [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]

    def decode_window(self, request_ids: set[str]) -> DecodeWindow:
        """Time the steps after every request in `request_ids` (all submitted together, none else running) has
        its first token, up to the step they finish in. The first stats report inside the window is skipped: it
        may cover steps from before the window."""
        started: set[str] = set()
        start_index = None
        for index, record in enumerate(self.records):
            started.update(r for r in record.request_ids if r in request_ids)
            if started == request_ids:
                start_index = index
                break
        if start_index is None:
            raise ValueError("not every request produced a token")
        window = self.records[start_index + 1 :]
        finished_at = next((i for i, r in enumerate(window) if r.finished_ids), len(window) - 1)
        window = window[: finished_at + 1]
        if any(set(r.request_ids) != request_ids for r in window):
            raise ValueError("a step in the decode window did not decode every request once")
        if len(window) < 2:
            raise WindowTooShort("the decode window is too short to time; ask for more output tokens")
        reports = [r.stats for r in window if r.stats is not None][1:]
        stats_steps = sum(s.num_steps for s in reports)
        if stats_steps == 0:
            raise WindowTooShort("no scheduler stats arrived inside the decode window; ask for more output tokens")
        wall = (window[-1].arrival_s - self.records[start_index].arrival_s) / len(window)
        return DecodeWindow(
            len(request_ids),
            len(window),
            wall,
            stats_steps,
            sum(s.step_time_s for s in reports) / stats_steps,
            sum(s.model_time_s for s in reports) / stats_steps,
        )
