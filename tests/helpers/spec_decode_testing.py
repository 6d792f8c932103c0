"""Speculative decoding in the scheduler without a model: a fake worker that verifies drafts against a target output."""

from __future__ import annotations

import msgspec

from tests.helpers.sched_testing import EOS, FakeWorker, make_config
from tokenmill.config import SpeculativeConfig, replace
from tokenmill.messages import StepPlan, StepResult
from tokenmill.scheduler.scheduler import Scheduler

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)


PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]


# the "model" copies the prompt with a few changes, so drafts are accepted and rejected
TARGET = [11, 12, 13, 14, 15, 99, 17, 18, 19, 20, 21, 22, 98, 24, 25, 26, 27, 28, 29, 30, 31, 32]


class SpecFakeWorker(FakeWorker):
    """A fake worker whose model continues each request with `target(request_id)`; it writes the KV of drafts,
    verifies them (accept while equal, as greedy verification), and checks all KV it attends to is the request's own
    tokens (so a rollback that kept a rejected draft's KV as computed fails the next step)."""

    def __init__(self, block_size: int, target) -> None:
        super().__init__(block_size)
        self.target = target
        self.drafts_seen: list[tuple[str, list[int]]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        drafts = {r.request_id: r.spec_token_ids for r in plan.running if r.spec_token_ids}
        for request_id, request_drafts in drafts.items():
            self.drafts_seen.append((request_id, list(request_drafts)))
        for run_data in plan.running:
            if run_data.request_id in drafts:
                assert run_data.num_scheduled_tokens == 1 + len(drafts[run_data.request_id])
        # apply with the drafts as known tokens (the base class checks slots and KV), then take them back out
        plan_copy = msgspec.structs.replace(
            plan,
            running=[
                msgspec.structs.replace(r, new_token_ids=r.new_token_ids + r.spec_token_ids) if r.spec_token_ids else r
                for r in plan.running
            ],
        )
        scheduled = self.apply(plan_copy)
        request_ids, first, accepted = [], [], []
        for request_id in scheduled:
            state = self.state[request_id]
            if state.num_computed_tokens < len(state.token_ids):
                continue
            request_drafts = drafts.get(request_id, [])
            known = state.token_ids[: len(state.token_ids) - len(request_drafts)]
            output = known[state.num_prompt_tokens :]
            target = self.target(request_id)
            tokens = []
            for j in range(len(request_drafts) + 1):
                next_token = target[len(output) + j] if len(output) + j < len(target) else EOS
                tokens.append(next_token)
                if j == len(request_drafts) or request_drafts[j] != next_token:
                    break
            del state.token_ids[len(known) :]  # drafts were this step only
            state.num_computed_tokens = len(known) + len(tokens) - 1
            request_ids.append(request_id)
            first.append(tokens[0])
            accepted.append(tokens)
        return StepResult(plan.step_id, request_ids, first, accepted_token_ids=accepted)


def run(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 500):
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs, finish, plans
        plan = scheduler.schedule()
        assert plan is not None
        plans.append(plan)
        for out in scheduler.update(plan, worker.execute(plan)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
        check_indexed_blocks(scheduler)
    raise AssertionError("not finished")


def make_scheduler(
    speculative=NGRAM, num_blocks: int = 64, max_speculating_batch: int | None = 8, **config
) -> Scheduler:
    """A scheduler whose requests speculate up to batch `max_speculating_batch` (vLLM's disable_by_batch_size; None:
    tokenmill's default, which exercises less)."""
    if speculative.method is not None:
        speculative = replace(speculative, disable_by_batch_size=max_speculating_batch)
    return Scheduler(replace(make_config(**config), speculative=speculative), num_blocks, [EOS])


def check_indexed_blocks(scheduler: Scheduler) -> None:
    """Prefix-cache entries only ever cover computed (accepted) tokens."""
    for req in scheduler.running:
        indexed = scheduler.kv.num_indexed_blocks.get(req.request_id, 0)
        assert indexed * scheduler.block_size <= req.num_computed_tokens <= req.num_tokens
