"""Overlap scheduling in the scheduler core: step N+1 planned before step N's result, with a placeholder for the token
step N samples; the same outputs as the synchronous scheduler, no KV block leaked, and the steps that must wait for
their tokens (structured outputs, speculative decoding) planned synchronously."""

from __future__ import annotations

import pytest

from tests.helpers.sched_testing import (
    EOS,
    FakeWorker,
    WorkerRequestState,
    drive,
    make_config,
    make_request,
    scheduled_tokens,
)
from tests.helpers.spec_decode_testing import NGRAM, PROMPT, TARGET, SpecFakeWorker
from tests.helpers.spec_decode_testing import make_scheduler as make_spec_scheduler
from tokenmill.config import EngineConfig
from tokenmill.messages import EngineRequest, RequestOutput, StepPlan, StepResult
from tokenmill.scheduler.scheduler import Scheduler


def sample_from_context(request_id: str, state: WorkerRequestState) -> int:
    """A deterministic 'model': the next token follows from the tokens so far (EOS = 2 now and then)."""
    return (sum(state.token_ids) * 31 + 7 * len(state.token_ids)) % 41


def run(
    config: EngineConfig,
    num_blocks: int,
    requests: list[EngineRequest],
    *,
    overlap: bool,
    abort_after: dict[str, int] | None = None,
) -> tuple[dict[str, list[RequestOutput]], Scheduler, FakeWorker]:
    sched = Scheduler(config, num_blocks, [EOS])
    worker = FakeWorker(config.cache.block_size, sample_from_context)
    for request in requests:
        assert sched.add_request(request) is None

    def abort_streamed(outputs: dict[str, list[RequestOutput]]) -> None:
        for request_id, count in (abort_after or {}).items():
            streamed = sum(len(out.new_token_ids) for out in outputs.get(request_id, []))
            if streamed >= count and request_id in sched.requests:
                for out in sched.abort_requests([request_id]):
                    outputs.setdefault(out.request_id, []).append(out)

    outputs = drive(sched, worker, overlap=overlap, before_schedule=abort_streamed)
    return outputs, sched, worker


def streams(outputs: dict[str, list[RequestOutput]]) -> dict[str, tuple[list[int], str | None, int | None]]:
    """Per request: every token streamed, its finish reason and stop reason."""
    return {
        request_id: ([t for out in outs for t in out.new_token_ids], outs[-1].finish_reason, outs[-1].stop_reason)
        for request_id, outs in outputs.items()
    }


def prompt(seed: int, length: int) -> list[int]:
    """Tokens that depend on nothing but the arguments, so every scenario is the same whatever ran before it."""
    return [1000 + 97 * seed + 5 * j for j in range(length)]


def scenario_requests(name: str) -> tuple[EngineConfig, int, list[EngineRequest], dict[str, int]]:
    """(config, KV blocks, requests, abort after this many streamed tokens) of each scenario."""
    base = make_config(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256)
    if name == "chunked_prefill":
        requests = [make_request(f"r{i}", prompt(i, 40 + 13 * i), max_tokens=12, ignore_eos=True) for i in range(4)]
        return base, 128, requests, {}
    if name == "preemption":
        config = make_config(block_size=4, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
        requests = [make_request(f"r{i}", prompt(i, 9 + i), max_tokens=16, ignore_eos=True) for i in range(4)]
        return config, 14, requests, {}
    if name == "prefix_caching":
        shared = list(range(500, 524))
        return base, 64, [make_request(f"r{i}", shared + [600 + i], max_tokens=9) for i in range(5)], {}
    if name == "n_choices":
        return base, 64, [make_request("r", prompt(0, 10), max_tokens=8, n=3, ignore_eos=True)], {}
    if name == "stops":
        requests = [make_request(f"eos{i}", prompt(i, 5 + i), max_tokens=30) for i in range(6)]
        stop_ids = [7, 13, 19, 23, 29]
        requests += [make_request(f"stop{i}", prompt(10 + i, 5 + i), 30, stop_token_ids=stop_ids) for i in range(6)]
        requests += [make_request(f"len{i}", prompt(20 + i, 5 + i), 1 + i, ignore_eos=True) for i in range(4)]
        return base, 128, requests, {}
    if name == "aborts":
        requests = [make_request(f"r{i}", prompt(i, 6 + i), max_tokens=20, ignore_eos=True) for i in range(4)]
        return base, 64, requests, {"r0": 1, "r2": 5}
    raise ValueError(name)


SCENARIOS = ["chunked_prefill", "preemption", "prefix_caching", "n_choices", "stops", "aborts"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_overlapped_steps_give_the_synchronous_outputs_and_free_every_block(name):
    config, num_blocks, requests, aborts = scenario_requests(name)
    sync, _, _ = run(config, num_blocks, requests, overlap=False, abort_after=aborts)
    overlapped, sched, worker = run(config, num_blocks, requests, overlap=True, abort_after=aborts)
    assert streams(overlapped) == streams(sync)
    assert worker.num_appended_last_sampled > 0, "no step was planned ahead"
    assert sched.kv.pool.num_free_blocks == num_blocks
    assert not sched.requests and not sched.running and not sched.waiting
    if name == "preemption":
        assert sched.counter_totals()[2] > 0, "the scenario must preempt"
    if name == "stops":  # every kind of ending happened
        reasons = {(finish, stop is not None) for _, finish, stop in streams(sync).values()}
        assert {("stop", False), ("stop", True), ("length", False)} <= reasons


def test_the_next_step_is_planned_with_a_placeholder_for_the_token_in_flight():
    sched = Scheduler(make_config(block_size=4), 16, [EOS])
    sched.add_request(make_request("r", 4, max_tokens=5))
    first = sched.schedule()
    assert first is not None and sched.can_plan_ahead()
    second = sched.schedule()  # before the first step's result
    assert second is not None and not second.new_requests
    (running,) = second.running
    assert running.append_last_sampled and running.new_token_ids == []
    assert (running.num_computed_tokens, running.num_scheduled_tokens) == (4, 1)
    assert len(running.new_block_ids) == 1, "the placeholder's position 4 needs a second block"
    req = sched.requests["r"]
    assert (req.num_computed_tokens, req.num_output_placeholders) == (5, 2)

    assert sched.update(first, sampled(first, 11))[0].new_token_ids == [11]
    third = sched.schedule()
    assert third is not None
    assert third.running[0].new_token_ids == [] and third.running[0].append_last_sampled, "the worker has token 11"
    assert sched.update(second, sampled(second, 12))[0].new_token_ids == [12]
    assert sched.requests["r"].all_token_ids[-2:] == [11, 12]


def sampled(plan: StepPlan, token: int) -> StepResult:
    """The result of a step that sampled `token` for every request it scheduled."""
    request_ids = list(scheduled_tokens(plan))
    return StepResult(plan.step_id, request_ids, [token] * len(request_ids))


def test_speculative_decoding_plans_every_step_after_its_result():
    sched = make_spec_scheduler(NGRAM, max_model_len=128)
    sched.add_request(make_request("r", PROMPT, max_tokens=len(TARGET), ignore_eos=True))
    worker = SpecFakeWorker(4, lambda request_id: TARGET)
    first = sched.schedule()
    assert first is not None and not sched.can_plan_ahead()
    sched.update(first, worker.execute(first))
    outputs = drive(sched, worker, overlap=True)
    assert [t for out in outputs["r"] for t in out.new_token_ids] == TARGET[1:]
    assert worker.drafts_seen, "drafts were proposed"
    assert worker.num_appended_last_sampled == 0
    assert sched.kv.pool.num_free_blocks == 64
