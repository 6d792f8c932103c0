"""Unit tests of the Scheduler: budgets, chunked prefill, admission, preemption and resume, stop rules, aborts,
prefix-cache reuse, embeddings and stats."""

import msgspec
import pytest

from tests.helpers.sched_testing import (
    EOS,
    FakeWorker,
    make_config,
    make_request,
    run_to_completion,
    scheduled_tokens,
    step,
)
from tokenmill.messages import StepResult
from tokenmill.scheduler.scheduler import Scheduler


def make_scheduler(num_blocks: int = 64, **config) -> tuple[Scheduler, FakeWorker]:
    cfg = make_config(**config)
    return Scheduler(cfg, num_blocks, [EOS]), FakeWorker(cfg.cache.block_size)


# ---------------------------------------------------------------- budgets and chunking


def test_long_prompt_is_chunked_under_the_token_budget():
    sched, worker = make_scheduler(max_num_batched_tokens=32)
    assert sched.add_request(make_request("a", 100, max_tokens=2)) is None
    chunks = []
    for _ in range(4):
        plan, outputs = step(sched, worker)
        chunks.append(scheduled_tokens(plan)["a"])
        if len(chunks) < 4:
            assert outputs == []  # a prompt chunk samples nothing
    assert chunks == [32, 32, 32, 4]
    assert [o.new_token_ids for o in outputs] == [[7]]
    plan, outputs = step(sched, worker)
    assert scheduled_tokens(plan) == {"a": 1}
    assert outputs[0].finish_reason == "length"


def test_decodes_keep_getting_tokens_while_a_long_prompt_is_chunked():
    sched, worker = make_scheduler(max_num_batched_tokens=16, max_model_len=256)
    sched.add_request(make_request("decoder", 5, max_tokens=20))
    step(sched, worker)
    sched.add_request(make_request("long", 61, max_tokens=1))
    for _ in range(4):
        plan, outputs = step(sched, worker)
        counts = scheduled_tokens(plan)
        assert counts == {"decoder": 1, "long": 15}
        assert [o.request_id for o in outputs] == ["decoder"]
    plan, outputs = step(sched, worker)
    assert scheduled_tokens(plan) == {"decoder": 1, "long": 1}
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("decoder", None), ("long", "length")]


def test_token_and_sequence_budgets_are_respected():
    sched, worker = make_scheduler(max_num_batched_tokens=20, max_num_seqs=3)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 9, max_tokens=3))
    while sched.has_unfinished_requests():
        plan, _ = step(sched, worker)
        counts = scheduled_tokens(plan)
        assert sum(counts.values()) <= 20
        assert len(counts) <= 3
        assert len(sched.running) <= 3


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched, worker = make_scheduler(max_num_batched_tokens=16, chunked_prefill=False)
    sched.add_request(make_request("a", 10, max_tokens=3))
    sched.add_request(make_request("b", 10, max_tokens=3))
    plan, _ = step(sched, worker)
    assert scheduled_tokens(plan) == {"a": 10}  # b does not fit the 6 tokens left and is not split
    plan, _ = step(sched, worker)
    assert scheduled_tokens(plan) == {"a": 1, "b": 10}


def test_without_chunked_prefill_a_prompt_longer_than_the_budget_is_rejected():
    sched, _ = make_scheduler(max_num_batched_tokens=16, chunked_prefill=False)
    reason = sched.add_request(make_request("a", 17, max_tokens=1))
    assert reason is not None and "max_num_batched_tokens" in reason.message
    assert not sched.has_unfinished_requests()


# ---------------------------------------------------------------- admission


@pytest.mark.parametrize(
    "prompt, max_tokens, needle",
    [
        (100, 29, "maximum context length"),
        (128, None, "maximum context length"),
        (0, 4, "empty"),
        (4, 0, "max_tokens"),
    ],
)
def test_admission_rejects_requests_that_can_never_run(prompt, max_tokens, needle):
    sched, _ = make_scheduler(max_model_len=128)
    reason = sched.add_request(make_request("a", prompt, max_tokens=max_tokens))
    assert reason is not None and needle in reason.message and reason.kind == "invalid"
    assert not sched.has_unfinished_requests()


def test_admission_rejects_a_prompt_bigger_than_the_whole_pool():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_model_len=128)
    assert sched.add_request(make_request("fits", 16, max_tokens=4)) is None  # 16 tokens = 4 blocks
    reason = sched.add_request(make_request("too-big", 17, max_tokens=1))
    assert reason is not None and "blocks" in reason.message


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_a_request_longer_than_the_pool_is_admitted_and_ends_when_it_fills_the_pool(max_tokens):
    """max_model_len beyond the KV cache (only with an explicit block count): blocks are taken as tokens are
    scheduled, nothing is reserved for max_tokens up front, and a request alone in the pool ends at its size."""
    sched, worker = make_scheduler(num_blocks=4, block_size=4, max_model_len=128)
    assert sched.add_request(make_request("a", 6, max_tokens=max_tokens)) is None
    outputs = run_to_completion(sched, worker)["a"]
    assert len(outputs) == 10 and outputs[-1].finish_reason == "length"  # 6 + 10 tokens = the 4 blocks
    assert sched.kv.pool.num_free_blocks == 4


def test_requests_without_max_tokens_share_a_tiny_pool_by_preemption():
    sched, worker = make_scheduler(num_blocks=6, block_size=4, max_model_len=128)
    for name in "abc":
        assert sched.add_request(make_request(name, 5, max_tokens=None)) is None
    plan, first_outputs = step(sched, worker)
    assert set(scheduled_tokens(plan)) == {"a", "b", "c"}  # admitted on their prompts alone (2 blocks each)
    outputs = run_to_completion(sched, worker)
    assert sched.stats().num_preemptions > 0
    for name in "abc":
        assert len(first_outputs) == 3 and len(outputs[name]) == 24 - 5 - 1  # each fills the whole pool alone
        assert outputs[name][-1].finish_reason == "length"


def test_admission_rejects_duplicate_ids_and_a_full_queue():
    sched, _ = make_scheduler(max_waiting_requests=2)
    assert sched.add_request(make_request("a", 4)) is None
    assert "already in use" in sched.add_request(make_request("a", 4)).message
    assert sched.add_request(make_request("b", 4)) is None
    assert sched.add_request(make_request("c", 4)).kind == "overloaded"


def test_max_tokens_none_generates_up_to_max_model_len():
    sched, worker = make_scheduler(max_model_len=20)
    sched.add_request(make_request("a", 12, max_tokens=None))
    outputs = run_to_completion(sched, worker)["a"]
    assert len(outputs) == 8
    assert outputs[-1].finish_reason == "length"
    assert [o.finish_reason for o in outputs[:-1]] == [None] * 7


# ---------------------------------------------------------------- stop rules


def test_eos_stops_and_reports_the_stop_token():
    sched, _ = make_scheduler()
    worker = FakeWorker(4, sample=lambda rid, state: EOS if len(state.token_ids) >= 7 else 9)
    sched.add_request(make_request("a", 5, max_tokens=10))
    outputs = run_to_completion(sched, worker)["a"]
    assert [o.new_token_ids for o in outputs] == [[9], [9], [EOS]]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_token_id == EOS
    assert outputs[-1].stop_reason is None  # EOS is no stop_reason, as vLLM reports it


def test_eos_is_ignored_with_ignore_eos_and_before_min_tokens():
    sched, _ = make_scheduler()
    worker = FakeWorker(4, sample=lambda rid, state: EOS)
    sched.add_request(make_request("ignore", 5, max_tokens=3, ignore_eos=True))
    sched.add_request(make_request("min", 5, max_tokens=10, min_tokens=2))
    outputs = run_to_completion(sched, worker)
    assert len(outputs["ignore"]) == 3 and outputs["ignore"][-1].finish_reason == "length"
    assert outputs["ignore"][-1].stop_token_id is None
    assert len(outputs["min"]) == 2 and outputs["min"][-1].stop_token_id == EOS


def test_stop_token_ids_stop_generation():
    sched, _ = make_scheduler()
    worker = FakeWorker(4, sample=lambda rid, state: 42 if len(state.token_ids) == 6 else 9)
    sched.add_request(make_request("a", 5, max_tokens=10, stop_token_ids=[42]))
    outputs = run_to_completion(sched, worker)["a"]
    assert [o.new_token_ids for o in outputs] == [[9], [42]]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_token_id == 42
    assert outputs[-1].stop_reason == 42


def test_one_request_with_n_choices_runs_as_n_requests_admitted_together():
    sched, worker = make_scheduler(max_waiting_requests=4)
    group = make_request("g", 5, max_tokens=2)
    group = msgspec.structs.replace(group, sampling=msgspec.structs.replace(group.sampling, n=3, seed=4))
    assert sched.add_request(group) is None
    assert sorted(sched.requests) == ["g-0", "g-1", "g-2"]
    assert [sched.requests[f"g-{i}"].sampling.seed for i in range(3)] == [4, 5, 6]
    too_many = make_request("h", 5, max_tokens=2)
    too_many = msgspec.structs.replace(too_many, sampling=msgspec.structs.replace(too_many.sampling, n=2))
    assert sched.add_request(too_many).kind == "overloaded"  # 3 waiting + 2 > 4: all or none
    assert sorted(run_to_completion(sched, worker)) == ["g-0", "g-1", "g-2"]


def test_eos_listed_in_stop_token_ids_still_reports_no_stop_reason():
    """EOS is checked first, as vLLM does: the server and LLM used to disagree here."""
    sched, _ = make_scheduler()
    worker = FakeWorker(4, sample=lambda rid, state: EOS)
    sched.add_request(make_request("a", 5, max_tokens=10, stop_token_ids=[EOS]))
    sched.add_request(make_request("b", 5, max_tokens=10, stop_token_ids=[EOS], ignore_eos=True))
    outputs = run_to_completion(sched, worker)
    assert outputs["a"][-1].stop_token_id == EOS and outputs["a"][-1].stop_reason is None
    assert outputs["b"][-1].stop_token_id == EOS and outputs["b"][-1].stop_reason == EOS


def test_logprobs_are_passed_through():
    sched, worker = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=2, logprobs=1))
    plan = sched.schedule()
    entry = (-0.5, [7, 8], [-0.5, -1.5])
    outputs = sched.update(plan, StepResult(plan.step_id, ["a"], [7], logprobs=[entry]))
    assert outputs[0].logprobs == [entry]


def test_a_request_the_worker_did_not_answer_fails_instead_of_hanging():
    sched, _ = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=2))
    plan = sched.schedule()
    outputs = sched.update(plan, StepResult(plan.step_id, [], []))
    assert outputs[0].finish_reason == "error" and outputs[0].error
    assert not sched.has_unfinished_requests() and sched.kv.pool.num_free_blocks == 64


# ---------------------------------------------------------------- preemption


def test_preemption_frees_the_latest_request_and_resumes_it_in_full():
    # 4 blocks of 4 tokens; two requests of 6 prompt tokens take 2 blocks each, then both need a third
    sched, worker = make_scheduler(num_blocks=4, block_size=4, prefix_caching=False)
    sched.add_request(make_request("old", [1, 1, 1, 1, 1, 1], max_tokens=6))
    sched.add_request(make_request("new", [2, 2, 2, 2, 2, 2], max_tokens=6))
    for _ in range(3):  # computes positions 0-5, then 6, then 7: all within two blocks
        plan, _ = step(sched, worker)
        assert plan.finished_ids == []
    plan = sched.schedule()  # position 8 needs a third block each: only one is free
    assert plan.finished_ids == ["new"]
    assert scheduled_tokens(plan) == {"old": 1}
    assert sched.stats().num_preemptions == 1
    outputs = sched.update(plan, worker.execute(plan))
    assert [o.request_id for o in outputs] == ["old"]
    preempted = sched.requests["new"]
    tokens_at_preemption = list(preempted.all_token_ids)
    assert len(tokens_at_preemption) == 9 and preempted.num_computed_tokens == 0
    assert "new" not in sched.kv.req_blocks

    outputs = run_to_completion(sched, worker)
    resend = [n for n in worker.new_requests_seen if n.request_id == "new"][-1]
    assert resend.token_ids == tokens_at_preemption  # prompt + the outputs it had
    assert resend.num_prompt_tokens == 6 and resend.num_computed_tokens == 0
    assert resend.num_scheduled_tokens == 9
    assert len(outputs["new"]) == 3 and outputs["new"][-1].finish_reason == "length"
    assert sched.kv.pool.num_free_blocks == 4


def test_preempted_request_reuses_its_cached_prefix_on_resume():
    sched, worker = make_scheduler(num_blocks=5, block_size=4)
    sched.add_request(make_request("old", [1] * 8, max_tokens=2))
    sched.add_request(make_request("new", [2] * 8, max_tokens=8))
    step(sched, worker)  # both prompts: 2 blocks each, 1 block free
    plan, outputs = step(sched, worker)  # old takes the last block; new cannot grow and is preempted
    assert plan.finished_ids == ["new"]
    assert outputs[0].finish_reason == "length"  # old is done and frees its blocks
    plan, _ = step(sched, worker)
    (resend,) = plan.new_requests
    assert resend.request_id == "new" and len(resend.token_ids) == 9
    assert resend.num_computed_tokens == 8  # its full blocks came back from the prefix cache
    assert resend.num_scheduled_tokens == 1


# ---------------------------------------------------------------- aborts


def test_abort_is_idempotent_and_frees_blocks_at_once():
    sched, worker = make_scheduler(num_blocks=16)
    sched.add_request(make_request("a", 10, max_tokens=5))
    sched.add_request(
        make_request(
            "waiting",
            10,
            max_tokens=5,
        )
    )
    step(sched, worker)
    used = 16 - sched.kv.pool.num_free_blocks
    assert used > 0
    outputs = sched.abort_requests(["a", "waiting", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "abort"), ("waiting", "abort")]
    assert sched.kv.pool.num_free_blocks == 16
    assert sched.abort_requests(["a", "waiting"]) == []
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("b", 4))
    plan = sched.schedule()
    assert plan.finished_ids == ["a", "waiting"]  # both had been sent to the workers


def test_aborting_a_request_the_workers_never_saw_sends_nothing():
    sched, worker = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 4, max_tokens=3))
    sched.add_request(make_request("queued", 4, max_tokens=3))
    step(sched, worker)
    assert sched.abort_requests(["queued"])[0].finish_reason == "abort"
    plan, _ = step(sched, worker)
    assert plan.finished_ids == []


def test_result_for_a_request_aborted_during_the_step_is_dropped():
    sched, worker = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=3))
    sched.add_request(make_request("b", 4, max_tokens=3))
    plan = sched.schedule()
    result = worker.execute(plan)
    sched.abort_requests(["a"])
    outputs = sched.update(plan, result)
    assert [o.request_id for o in outputs] == ["b"]


# ---------------------------------------------------------------- prefix cache, embeddings, stats


def test_second_request_with_the_same_prompt_hits_the_prefix_cache():
    sched, worker = make_scheduler(block_size=4)
    prompt = list(range(200, 218))  # 18 tokens: 4 full blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, worker)
    sched.stats()
    sched.add_request(make_request("b", prompt, max_tokens=1))
    plan = sched.schedule()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 16 and new.num_scheduled_tokens == 2
    outputs = sched.update(plan, worker.execute(plan))
    assert outputs[0].num_cached_tokens == 16 and outputs[0].num_prompt_tokens == 18
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 16)
    assert sched.stats().prefix_cache_queries == 0  # counters reset on each report


def test_colliding_prefix_cache_keys_never_let_a_request_read_another_requests_kv(monkeypatch):
    """Every block key collides; the fake worker asserts each request attends only to KV of its own tokens."""
    from tokenmill.scheduler import kv_cache_manager

    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda parent, token_ids, extra_key: b"\0" * 32)
    sched, worker = make_scheduler(block_size=4)
    sched.add_request(make_request("victim", list(range(200, 218)), max_tokens=3))
    run_to_completion(sched, worker)
    sched.add_request(make_request("attacker", list(range(300, 318)), max_tokens=3))
    outputs = run_to_completion(sched, worker)["attacker"]
    assert outputs[0].num_cached_tokens == 0 and outputs[-1].finish_reason == "length"


def test_embedding_requests_run_whole_without_blocks():
    sched, worker = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("e1", 10, task="embed"))
    sched.add_request(make_request("e2", 10, task="embed"))
    plan = sched.schedule()
    assert scheduled_tokens(plan) == {"e1": 10}  # e2 is never split, so it waits
    assert plan.new_requests[0].block_ids == [] and plan.new_requests[0].task == "embed"
    outputs = sched.update(plan, worker.execute(plan))
    assert outputs[0].finish_reason == "stop" and outputs[0].embedding == bytes(12)
    outputs = run_to_completion(sched, worker)
    assert outputs["e2"][0].embedding is not None
    assert sched.kv.pool.num_free_blocks == 64


def test_embedding_longer_than_the_budget_is_rejected():
    sched, _ = make_scheduler(max_num_batched_tokens=16)
    assert "never split" in sched.add_request(make_request("e", 17, task="embed")).message


def test_stats_report_queues_and_kv_usage():
    sched, worker = make_scheduler(num_blocks=10, max_num_seqs=1)
    sched.add_request(make_request("a", 8, max_tokens=4))
    sched.add_request(make_request("b", 8, max_tokens=4))
    step(sched, worker)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(0.2)  # 8 computed tokens in blocks of 4
