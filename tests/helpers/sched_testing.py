"""Test helpers for the scheduler: small configs, requests, a fake clock and a fake worker that mirrors plans.

The fake worker keeps the per-request state a real worker keeps (tokens, block table, computed tokens) and a map of
which token each KV slot holds. It applies each plan's diffs, asserts they are consistent and that every request
attends only to KV of its own tokens, then "samples" a token for every request whose scheduled tokens reach its end,
exactly when a real worker would. Under overlap scheduling it appends the token it sampled last step where a plan
says so, as a real worker does; `drive` runs steps as the scheduler process does, with or without overlap.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.messages import EngineRequest, NewRequestData, RequestOutput, SamplingParams, StepPlan, StepResult
from tokenmill.scheduler.scheduler import Scheduler

EOS = 2
_distinct_token_base = itertools.count(1000, 1000)


def make_config(
    *,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 128,
    chunked_prefill: bool = True,
    prefix_caching: bool = True,
    policy: str = "fcfs",
    max_waiting_requests: int = 4096,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked_prefill,
            scheduling_policy=policy,
            max_waiting_requests=max_waiting_requests,
        ),
    )


def make_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int | None = 4,
    *,
    priority: int = 0,
    cache_salt: str | None = None,
    task: str = "generate",
    **sampling,
) -> EngineRequest:
    """A request; an int prompt means that many tokens no other request uses, so no two prompts share blocks
    unless the test builds them to."""
    if isinstance(prompt, int):
        base = next(_distinct_token_base)
        tokens = list(range(base, base + prompt))
    else:
        tokens = list(prompt)
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        task=task,
        priority=priority,
        cache_salt=cache_salt,
    )


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class WorkerRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    task: str
    scheduled_history: list[int] = field(default_factory=list)


class FakeWorker:
    """Applies plans like a worker would and answers with fake sampled tokens."""

    def __init__(self, block_size: int, sample: Callable[[str, WorkerRequestState], int] | None = None) -> None:
        self.block_size = block_size
        self.sample = sample or (lambda request_id, state: 7)
        self.state: dict[str, WorkerRequestState] = {}
        self.forgotten: list[str] = []
        self.new_requests_seen: list[NewRequestData] = []  # every request sent in full, resends included
        self.kv_content: dict[tuple[int, int], int] = {}  # (block id, slot) -> token whose KV was written there
        self.last_sampled: dict[str, int] = {}  # request id -> the token it sampled last step
        self.num_appended_last_sampled = 0  # plans' placeholders filled from last_sampled

    def apply(self, plan: StepPlan) -> dict[str, int]:
        """Apply the plan's diffs, check them, and return request id -> tokens scheduled."""
        for request_id in plan.finished_ids:
            assert request_id in self.state, f"told to forget {request_id!r}, which the worker never saw"
            del self.state[request_id]
            self.forgotten.append(request_id)
        scheduled: dict[str, int] = {}
        for new in plan.new_requests:
            assert new.request_id not in self.state, f"{new.request_id!r} sent in full twice"
            assert new.num_computed_tokens % self.block_size == 0, "cached prefix must be whole blocks"
            self.state[new.request_id] = WorkerRequestState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.num_computed_tokens, new.task
            )
            scheduled[new.request_id] = new.num_scheduled_tokens
            self.new_requests_seen.append(new)
        for run in plan.running:
            state = self.state[run.request_id]
            assert run.num_computed_tokens == state.num_computed_tokens, "scheduler and worker disagree on progress"
            state.token_ids.extend(run.new_token_ids)
            if run.append_last_sampled:
                state.token_ids.append(self.last_sampled[run.request_id])
                self.num_appended_last_sampled += 1
            state.block_ids.extend(run.new_block_ids)
            scheduled[run.request_id] = run.num_scheduled_tokens
        for request_id, num_scheduled in scheduled.items():
            state = self.state[request_id]
            assert num_scheduled > 0
            end = state.num_computed_tokens + num_scheduled
            assert end <= len(state.token_ids), "scheduled past the known tokens"
            if state.task == "generate":
                assert len(state.block_ids) * self.block_size >= end, "no KV slot for a scheduled token"
                self.check_and_write_kv(state, end)
            state.num_computed_tokens = end
            state.scheduled_history.append(num_scheduled)
        return scheduled

    def slot(self, state: WorkerRequestState, position: int) -> tuple[int, int]:
        return state.block_ids[position // self.block_size], position % self.block_size

    def check_and_write_kv(self, state: WorkerRequestState, end: int) -> None:
        """The KV a request attends to must be its own tokens: the computed ones (prefix-cache hits included) are
        checked against what was written into those slots, then this step writes the scheduled ones."""
        for position in range(state.num_computed_tokens):
            assert self.kv_content.get(self.slot(state, position)) == state.token_ids[position], (
                f"stale KV at position {position}: a shared block holds other tokens"
            )
        for position in range(state.num_computed_tokens, end):
            self.kv_content[self.slot(state, position)] = state.token_ids[position]

    def execute(self, plan: StepPlan) -> StepResult:
        scheduled = self.apply(plan)
        request_ids, tokens, embeddings = [], [], {}
        for request_id in scheduled:
            state = self.state[request_id]
            if state.num_computed_tokens < len(state.token_ids):
                continue  # a prompt chunk: nothing to sample yet
            if state.task == "embed":
                embeddings[request_id] = bytes(4 * 3)
            else:
                request_ids.append(request_id)
                tokens.append(self.sample(request_id, state))
        self.last_sampled = dict(zip(request_ids, tokens))
        return StepResult(plan.step_id, request_ids, tokens, embeddings=embeddings or None)


def step(scheduler: Scheduler, worker: FakeWorker) -> tuple[StepPlan | None, list[RequestOutput]]:
    """One engine step: plan, fake execution, update."""
    plan = scheduler.schedule()
    if plan is None:
        return None, []
    return plan, scheduler.update(plan, worker.execute(plan))


def run_to_completion(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 1000
) -> dict[str, list[RequestOutput]]:
    """Step until nothing is unfinished; returns every request's outputs in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        plan, step_outputs = step(scheduler, worker)
        assert plan is not None, "unfinished requests but nothing scheduled"
        for out in step_outputs:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"not finished after {max_steps} steps")


def drive(
    scheduler: Scheduler,
    worker: FakeWorker,
    *,
    overlap: bool,
    before_schedule: Callable[[dict[str, list[RequestOutput]]], None] | None = None,
    max_steps: int = 1000,
) -> dict[str, list[RequestOutput]]:
    """Run until nothing is unfinished as the scheduler process does (`SchedulerLoop.run_once`): with `overlap`, step
    N+1 is planned (when the scheduler can) before step N's result is applied. `before_schedule` sees the outputs
    so far before each planning (to abort, say). Returns every request's outputs in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    in_flight: tuple[StepPlan, StepResult] | None = None
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            return outputs
        if before_schedule is not None:
            before_schedule(outputs)
        plan = None
        if in_flight is None or (overlap and scheduler.can_plan_ahead()):
            plan = scheduler.schedule()
        # the worker runs plans in order, each as soon as it arrives
        executed = (plan, worker.execute(plan)) if plan is not None else None
        if in_flight is not None:
            step_outputs = scheduler.update(*in_flight)
        else:
            step_outputs = scheduler.take_pending_outputs()
            assert plan is not None or not scheduler.has_unfinished_requests(), "unfinished but nothing scheduled"
        for out in step_outputs:
            outputs.setdefault(out.request_id, []).append(out)
        in_flight = executed
    raise AssertionError(f"not finished after {max_steps} steps")


def scheduled_tokens(plan: StepPlan) -> dict[str, int]:
    counts = {n.request_id: n.num_scheduled_tokens for n in plan.new_requests}
    counts.update({r.request_id: r.num_scheduled_tokens for r in plan.running})
    return counts
