"""Requests that ask for prompt logprobs: they never read the prefix cache (their whole prompt is computed, so every
position has a hidden state to score), still feed it, leak no blocks, and get the worker's entries on their first
output only."""

from tests.helpers.sched_testing import FakeWorker, make_config, make_request, run_to_completion, step
from tokenmill.messages import PromptLogprobs, StepResult
from tokenmill.scheduler.scheduler import Scheduler

PROMPT = list(range(300, 318))  # 18 tokens: 4 full blocks of 4


def make_scheduler(num_blocks: int = 64, **config) -> tuple[Scheduler, FakeWorker]:
    cfg = make_config(**config)
    return Scheduler(cfg, num_blocks, [2]), FakeWorker(cfg.cache.block_size)


def new_request_data(worker: FakeWorker, request_id: str):
    return [n for n in worker.new_requests_seen if n.request_id == request_id]


def test_a_prompt_logprobs_request_never_reads_the_prefix_cache_but_feeds_it():
    sched, worker = make_scheduler(max_num_batched_tokens=256)  # the prompt in one prompt-logprobs chunk
    sched.add_request(make_request("warm", PROMPT, max_tokens=1))
    run_to_completion(sched, worker)
    sched.stats()
    sched.add_request(make_request("scored", PROMPT, max_tokens=2, prompt_logprobs=1))
    outputs = run_to_completion(sched, worker)
    (sent,) = new_request_data(worker, "scored")
    assert sent.num_computed_tokens == 0 and sent.num_scheduled_tokens == len(PROMPT)
    assert outputs["scored"][0].num_cached_tokens == 0
    assert sched.stats().prefix_cache_hits == 0
    # an ordinary request with the same prompt still reads the cache
    sched.add_request(make_request("plain", PROMPT, max_tokens=1))
    outputs = run_to_completion(sched, worker)
    assert new_request_data(worker, "plain")[0].num_computed_tokens == 16
    assert outputs["plain"][0].num_cached_tokens == 16
    assert sched.kv.pool.num_free_blocks == 64


def test_only_blocks_a_prompt_logprobs_request_computed_itself_are_cached_for_others():
    # with nothing cached before it, the scored request's own blocks serve a later plain request
    sched, worker = make_scheduler()
    sched.add_request(make_request("scored", PROMPT, max_tokens=1, prompt_logprobs=0))
    run_to_completion(sched, worker)
    sched.add_request(make_request("plain", PROMPT, max_tokens=1))
    run_to_completion(sched, worker)
    assert new_request_data(worker, "plain")[0].num_computed_tokens == 16


def test_preempted_prompt_logprobs_request_recomputes_everything_and_leaks_no_blocks():
    # 5 blocks of 4: two 8-token prompts take 2 blocks each; the younger one is preempted when both grow
    sched, worker = make_scheduler(num_blocks=5, block_size=4)
    sched.add_request(make_request("old", [1] * 8, max_tokens=3))
    sched.add_request(make_request("scored", [2] * 8, max_tokens=8, prompt_logprobs=2))
    step(sched, worker)
    plan, _ = step(sched, worker)
    assert plan.finished_ids == ["scored"]
    outputs = run_to_completion(sched, worker)
    first, resend = new_request_data(worker, "scored")
    assert resend.num_computed_tokens == 0  # its own cached blocks are not read back either
    assert len(resend.token_ids) == 9 and resend.num_scheduled_tokens == 9
    assert outputs["scored"][-1].finish_reason == "length"
    assert sched.kv.pool.num_free_blocks == 5 and not sched.kv.req_blocks


def test_chunked_prompt_logprobs_request_aborted_mid_prompt_frees_its_blocks():
    sched, worker = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("scored", 30, max_tokens=2, prompt_logprobs=3))
    step(sched, worker)
    step(sched, worker)
    assert sched.kv.pool.num_free_blocks < 64
    assert [o.finish_reason for o in sched.abort_requests(["scored"])] == ["abort"]
    assert sched.kv.pool.num_free_blocks == 64


def test_prompt_logprobs_ride_on_the_first_output_of_their_request_only():
    sched, worker = make_scheduler()
    sched.add_request(make_request("scored", 5, max_tokens=2, prompt_logprobs=1))
    sched.add_request(make_request("plain", 5, max_tokens=2))
    plan = sched.schedule()
    entries = PromptLogprobs.from_entries([(-1.5, 3, [9], [-0.25])] * 4, 1)
    result = worker.execute(plan)
    outputs = sched.update(
        plan,
        StepResult(result.step_id, result.request_ids, result.sampled_token_ids, prompt_logprobs={"scored": entries}),
    )
    by_id = {o.request_id: o for o in outputs}
    assert by_id["scored"].prompt_logprobs == entries and by_id["plain"].prompt_logprobs is None
    _, outputs = step(sched, worker)
    assert [o.prompt_logprobs for o in outputs] == [None, None]


def scheduled_per_step(sched: Scheduler, worker: FakeWorker) -> list[dict[str, int]]:
    """Each step's tokens per request until every request has finished."""
    scheduled: list[dict[str, int]] = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched, worker)
        scheduled.append(
            {n.request_id: n.num_scheduled_tokens for n in plan.new_requests}
            | {r.request_id: r.num_scheduled_tokens for r in plan.running}
        )
    return scheduled


def test_a_prompt_logprobs_position_is_charged_its_lm_head_in_the_step_budget():
    """Each prompt position that asks for its logprob costs 1 + the worker's row cost tokens of the budget: with a
    row cost of 3 and a 64-token budget the prompt runs 16 positions a step, and a running decoder ahead of it keeps
    its token every step (the chunk shrinks to the rest)."""
    cfg = make_config(max_num_batched_tokens=64)
    sched, worker = Scheduler(cfg, 256, [2], prompt_logprobs_row_cost=3.0), FakeWorker(cfg.cache.block_size)
    sched.add_request(make_request("decoder", 4, max_tokens=12, ignore_eos=True))
    step(sched, worker)
    sched.add_request(make_request("scored", 3 * 16 + 5, max_tokens=1, prompt_logprobs=2))
    scheduled = scheduled_per_step(sched, worker)
    # 63 tokens of budget after the decoder's one: 15 positions (60 tokens) a step, then the last 8
    assert [s.get("scored") for s in scheduled[:4]] == [15, 15, 15, 8]
    assert all(s["decoder"] == 1 for s in scheduled[:4])
    assert sched.kv.pool.num_free_blocks == 256


def test_a_prompt_logprobs_position_dearer_than_the_budget_still_advances_one_a_step():
    cfg = make_config(max_num_batched_tokens=32)
    sched, worker = Scheduler(cfg, 64, [2], prompt_logprobs_row_cost=100.0), FakeWorker(cfg.cache.block_size)
    sched.add_request(make_request("scored", 5, max_tokens=1, prompt_logprobs=0))
    sched.add_request(make_request("plain", 8, max_tokens=1))
    scheduled = scheduled_per_step(sched, worker)
    # the budget is spent by the one position: nothing is scheduled after it until the prompt is done
    assert scheduled == [{"scored": 1}] * 5 + [{"plain": 8}]


def test_without_prompt_logprobs_or_once_delivered_tokens_cost_one_each():
    cfg = make_config(max_num_batched_tokens=32)
    sched, worker = Scheduler(cfg, 64, [2], prompt_logprobs_row_cost=100.0), FakeWorker(cfg.cache.block_size)
    sched.add_request(make_request("plain", 20, max_tokens=1))
    sched.add_request(make_request("second", 12, max_tokens=1))
    assert scheduled_per_step(sched, worker)[0] == {"plain": 20, "second": 12}
