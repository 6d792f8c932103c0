"""Draft-model speculation in the scheduler: the workers' proposals scheduled next step, lookahead slots for the
draft's KV, stale proposals dropped, requests that may not speculate never drafted, outputs unchanged."""

from __future__ import annotations

from tests.helpers.sched_testing import EOS, make_request
from tests.helpers.spec_decode_testing import PROMPT, TARGET, SpecFakeWorker, make_scheduler, run
from tokenmill.config import SpeculativeConfig
from tokenmill.messages import StepPlan, StepResult

K = 3
DRAFT_MODEL = SpeculativeConfig(method="draft_model", num_speculative_tokens=K, model="draft", path="/draft")
# the "draft model" believes the output copies the prompt: right until TARGET's changes
DRAFT = PROMPT + [31, 32]


class DraftFakeWorker(SpecFakeWorker):
    """SpecFakeWorker that also answers with a fake draft model's k proposals after every sampled request's newest
    token, and checks the request's blocks hold the draft's lookahead writes (when `expect_lookahead`)."""

    def __init__(self, block_size: int, expect_lookahead: bool = True) -> None:
        super().__init__(block_size, lambda request_id: TARGET)
        self.expect_lookahead = expect_lookahead
        self.proposed_for: set[str] = set()

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        proposals = []
        for request_id, tokens in zip(result.request_ids, result.accepted_token_ids):
            state = self.state[request_id]
            num_outputs = len(state.token_ids) - state.num_prompt_tokens + len(tokens)
            newest_position = len(state.token_ids) + len(tokens) - 1
            # the draft writes positions newest .. newest + k - 1 (a request that may not speculate gets no lookahead:
            # the real worker proposes only where its table reaches)
            if self.expect_lookahead and request_id != "penalty":
                assert len(state.block_ids) * self.block_size >= newest_position + K, request_id
            proposals.append(DRAFT[num_outputs : num_outputs + K])
            self.proposed_for.add(request_id)
        result.draft_token_ids = proposals
        return result


def test_draft_model_proposals_are_verified_and_outputs_unchanged():
    results = {}
    for speculative in (SpeculativeConfig(), DRAFT_MODEL):
        scheduler = make_scheduler(speculative, block_size=4, max_num_batched_tokens=64)
        worker = DraftFakeWorker(4, expect_lookahead=speculative.method is not None)
        for i in range(3):
            scheduler.add_request(make_request(f"r{i}", PROMPT, max_tokens=30, ignore_eos=False))
        scheduler.add_request(make_request("penalty", PROMPT, max_tokens=30, ignore_eos=False, repetition_penalty=1.2))
        outputs, finish, plans = run(scheduler, worker)
        results[speculative.method] = outputs, finish, len(plans), worker, scheduler
    plain, plain_finish, plain_steps, _, _ = results[None]
    spec, spec_finish, spec_steps, worker, scheduler = results["draft_model"]
    assert spec == plain and spec_finish == plain_finish and spec["r0"] == TARGET + [EOS]
    assert spec_steps <= plain_steps  # the request with a penalty decodes one token a step in both
    drafted = {request_id for request_id, _ in worker.drafts_seen}
    assert drafted == {"r0", "r1", "r2"} and "penalty" in worker.proposed_for  # proposed, never scheduled
    assert all(len(drafts) <= K for _, drafts in worker.drafts_seen)
    stats = scheduler.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert not scheduler.kv.req_blocks and scheduler.kv.pool.num_free_blocks == 64  # lookahead blocks freed too


def test_stale_proposal_is_not_scheduled():
    from tokenmill.scheduler.draft_speculator import DraftModelSpeculator
    from tokenmill.scheduler.request import Request

    speculator = DraftModelSpeculator(DRAFT_MODEL)
    req = Request(make_request("r", PROMPT, max_tokens=30), 0, 0.0, 30)
    speculator.receive(req, [1, 2, 3])
    assert speculator.propose(req, limit=2) == [1, 2]  # cut to the limit, then used up
    assert speculator.propose(req, limit=2) == []
    speculator.receive(req, [1, 2, 3])
    req.all_token_ids.append(7)  # the request moved on without the proposal being scheduled
    assert speculator.propose(req, limit=3) == []


def test_short_pool_gets_fewer_lookahead_slots_not_preemptions():
    """6 blocks of 4 for one 20-token prompt growing to 24: lookahead past the pool is skipped, nothing preempted."""
    scheduler = make_scheduler(DRAFT_MODEL, num_blocks=6, block_size=4)
    worker = DraftFakeWorker(4, expect_lookahead=False)
    scheduler.add_request(make_request("r", PROMPT, max_tokens=4))
    outputs, _, _ = run(scheduler, worker)
    assert outputs["r"] == TARGET[:4]
    assert scheduler.counter_totals()[2] == 0


def test_one_allocation_per_request_per_step_when_the_pool_has_room():
    """The new tokens, the drafts and the draft model's lookahead slots are asked for in one allocate_slots call."""
    scheduler = make_scheduler(DRAFT_MODEL, block_size=4, max_num_batched_tokens=64)
    worker = DraftFakeWorker(4)
    calls_per_step: list[list[str]] = []
    allocate, schedule = scheduler.kv.allocate_slots, scheduler.schedule

    def counting_allocate(request, *args, **kwargs):
        calls_per_step[-1].append(request.request_id)
        return allocate(request, *args, **kwargs)

    def counting_schedule():
        calls_per_step.append([])
        return schedule()

    scheduler.kv.allocate_slots = counting_allocate
    scheduler.schedule = counting_schedule
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", PROMPT, max_tokens=20))
    outputs, _, _ = run(scheduler, worker)
    assert outputs["r0"] == TARGET[:20] and worker.drafts_seen
    assert all(len(calls) == len(set(calls)) for calls in calls_per_step), calls_per_step
