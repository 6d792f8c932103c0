"""Scheduling policies: the order in which requests get tokens, and therefore which running request is preempted.

Every policy is a sort key (lower runs first). Running requests are served in key order and, when blocks run out,
the one with the highest key is preempted. Waiting requests are admitted in key order.

- fcfs:     arrival order.
- priority: (priority, arrival); lower priority values run first, as in vLLM. A waiting request may also preempt a
            running one of strictly lower priority when the pool is short.
- sjf:      shortest expected remaining work first (prompt tokens still to compute + outputs still allowed), minus an
            ageing credit for time spent in the scheduler so a long job cannot be starved by a stream of short ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from tokenmill.scheduler.request import Request

# SJF ageing: each second in the scheduler counts as this many tokens of work already done. A job with W more tokens
# of work than a newcomer overtakes newcomers after W / rate seconds, whatever the arrival rate.
DEFAULT_SJF_AGEING_TOKENS_PER_S = 100.0


# compared element by element; the last element is always the arrival sequence (a unique tie-break)
SortKey = tuple[float, ...]


class SchedulingPolicy(ABC):
    name: str = ""
    preempts_for_waiting = False  # may a waiting request preempt a running one with a worse key?

    @abstractmethod
    def sort_key(self, request: Request, now: float) -> SortKey:
        """Lower keys are served first. `now` is the scheduler clock, fixed for one step."""

    def order(self, requests: Iterable[Request], now: float) -> list[Request]:
        return sorted(requests, key=lambda r: self.sort_key(r, now))


class FcfsPolicy(SchedulingPolicy):
    name = "fcfs"

    def sort_key(self, request: Request, now: float) -> SortKey:
        return (request.arrival_seq,)


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    preempts_for_waiting = True

    def sort_key(self, request: Request, now: float) -> SortKey:
        return (request.priority, request.arrival_seq)


class SjfPolicy(SchedulingPolicy):
    name = "sjf"

    def __init__(self, ageing_tokens_per_s: float = DEFAULT_SJF_AGEING_TOKENS_PER_S) -> None:
        if ageing_tokens_per_s <= 0:
            raise ValueError("SJF needs a positive ageing rate, or long jobs can starve")
        self.ageing_tokens_per_s = ageing_tokens_per_s

    def sort_key(self, request: Request, now: float) -> SortKey:
        waited_s = max(0.0, now - request.enqueue_time)
        return (request.remaining_work - waited_s * self.ageing_tokens_per_s, request.arrival_seq)


def make_policy(name: str) -> SchedulingPolicy:
    policies: dict[str, type[SchedulingPolicy]] = {"fcfs": FcfsPolicy, "priority": PriorityPolicy, "sjf": SjfPolicy}
    if name not in policies:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()
