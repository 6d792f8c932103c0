"""The scheduler with LoRA adapters: never more distinct adapters running than max_loras (base requests free), no
starvation of a waiting adapter behind a busy one, and prefix-cache keys that include the adapter."""

from __future__ import annotations

import random

import msgspec

from tests.helpers.sched_testing import FakeWorker, make_config, make_request, run_to_completion, scheduled_tokens, step
from tokenmill.config import EngineConfig, LoRAConfig
from tokenmill.messages import EngineRequest, LoRARequest
from tokenmill.scheduler.scheduler import Scheduler

ADAPTERS = {name: LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abcd", start=1)}


def lora_config(max_loras: int, **fields) -> EngineConfig:
    return msgspec.structs.replace(
        make_config(**fields), lora=LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=64)
    )


def with_adapter(request: EngineRequest, adapter: str | None) -> EngineRequest:
    return msgspec.structs.replace(request, lora_request=ADAPTERS[adapter] if adapter else None)


def adapters_of(scheduler: Scheduler, request_ids) -> set[str]:
    lora = (scheduler.requests[r].lora_request for r in request_ids if r in scheduler.requests)
    return {x.lora_name for x in lora if x is not None}


def test_a_step_holds_at_most_max_loras_adapters_and_base_requests_do_not_count():
    scheduler = Scheduler(lora_config(2), num_kv_blocks=64, eos_token_ids=[])
    worker = FakeWorker(scheduler.block_size)
    plan_of = {"a1": "a", "b1": "b", "c1": "c", "base1": None, "a2": "a", "base2": None}
    for request_id, adapter in plan_of.items():
        assert scheduler.add_request(with_adapter(make_request(request_id, 6, max_tokens=3), adapter)) is None
    plan, _ = step(scheduler, worker)
    assert plan is not None
    # c1 has no slot; a2 waits behind it (its adapter runs, but it must not keep `a` busy while c1 waits)
    assert set(scheduled_tokens(plan)) == {"a1", "b1", "base1", "base2"}
    assert {n.lora_request.lora_name for n in plan.new_requests if n.lora_request} == {"a", "b"}
    seen_together: list[set[str]] = []
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, worker)
        assert plan is not None
        seen_together.append(adapters_of(scheduler, scheduled_tokens(plan)))
        assert len(adapters_of(scheduler, [r.request_id for r in scheduler.running])) <= 2
    assert all(len(adapters) <= 2 for adapters in seen_together)
    assert {"c"} <= set().union(*seen_together)  # c1 ran in the end


def test_a_waiting_adapter_is_not_starved_by_a_busy_one():
    """max_loras=1, adapter `a` gets a new request every step: `b`'s request still runs within a few steps (the `a`
    requests that arrive after it wait behind it, so the running ones drain and free the slot)."""
    scheduler = Scheduler(lora_config(1, max_num_seqs=64), num_kv_blocks=256, eos_token_ids=[])
    worker = FakeWorker(scheduler.block_size)
    scheduler.add_request(with_adapter(make_request("a0", 4, max_tokens=3), "a"))
    step(scheduler, worker)
    scheduler.add_request(with_adapter(make_request("b0", 4, max_tokens=3), "b"))
    b_ran_at = None
    for i in range(1, 30):
        scheduler.add_request(with_adapter(make_request(f"a{i}", 4, max_tokens=3), "a"))
        plan, _ = step(scheduler, worker)
        assert plan is not None
        assert len(adapters_of(scheduler, scheduled_tokens(plan))) <= 1
        if "b0" in scheduled_tokens(plan):
            b_ran_at = i
            break
    assert b_ran_at is not None and b_ran_at <= 5, "the waiting adapter starved"


def test_running_requests_are_not_preempted_for_an_adapter():
    scheduler = Scheduler(lora_config(1), num_kv_blocks=64, eos_token_ids=[])
    worker = FakeWorker(scheduler.block_size)
    scheduler.add_request(with_adapter(make_request("a0", 4, max_tokens=5), "a"))
    step(scheduler, worker)
    scheduler.add_request(with_adapter(make_request("b0", 4, max_tokens=2), "b"))
    order: list[str] = []
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, worker)
        assert plan is not None
        order.extend(r for r in scheduled_tokens(plan) if r not in order)
    assert order == ["a0", "b0"] and scheduler.stats().num_preemptions == 0


def cached_tokens(scheduler: Scheduler, worker: FakeWorker, request: EngineRequest) -> int:
    assert scheduler.add_request(request) is None
    outputs = run_to_completion(scheduler, worker)[request.request_id]
    return outputs[-1].num_cached_tokens


def test_prefix_cache_keys_include_the_adapter():
    scheduler = Scheduler(lora_config(4), num_kv_blocks=64, eos_token_ids=[])
    worker = FakeWorker(scheduler.block_size)
    prompt = list(range(100, 117))  # four full blocks of 4 and one token more
    assert cached_tokens(scheduler, worker, with_adapter(make_request("a0", prompt, 2), "a")) == 0
    assert cached_tokens(scheduler, worker, with_adapter(make_request("b0", prompt, 2), "b")) == 0
    assert cached_tokens(scheduler, worker, make_request("base0", prompt, 2)) == 0
    assert cached_tokens(scheduler, worker, with_adapter(make_request("a1", prompt, 2), "a")) == 16
    assert cached_tokens(scheduler, worker, with_adapter(make_request("b1", prompt, 2), "b")) == 16
    assert cached_tokens(scheduler, worker, make_request("base1", prompt, 2)) == 16
    # the same name loaded again is a new id: its old KV is not its KV
    reloaded = msgspec.structs.replace(make_request("a2", prompt, 2), lora_request=LoRARequest("a", 99, "/new"))
    assert cached_tokens(scheduler, worker, reloaded) == 0


def test_a_cache_salt_never_spells_an_adapters_key():
    scheduler = Scheduler(lora_config(2), num_kv_blocks=64, eos_token_ids=[])
    worker = FakeWorker(scheduler.block_size)
    prompt = list(range(200, 209))
    salted = make_request("s0", prompt, 2, cache_salt="t")
    assert cached_tokens(scheduler, worker, with_adapter(salted, "a")) == 0
    assert cached_tokens(scheduler, worker, make_request("s1", prompt, 2, cache_salt="t")) == 0
    assert cached_tokens(scheduler, worker, make_request("s2", prompt, 2)) == 0
    assert cached_tokens(scheduler, worker, with_adapter(make_request("s3", prompt, 2, cache_salt="t"), "a")) == 8


def test_an_adapter_request_is_refused_when_lora_is_off():
    scheduler = Scheduler(make_config(), num_kv_blocks=64, eos_token_ids=[])
    rejection = scheduler.add_request(with_adapter(make_request("a0", 4), "a"))
    assert rejection is not None and "--enable-lora" in rejection.message
    lora_scheduler = Scheduler(lora_config(1), num_kv_blocks=64, eos_token_ids=[])
    embed = with_adapter(make_request("e0", 4, max_tokens=None, task="embed"), "a")
    assert lora_scheduler.add_request(embed) is not None


def test_stats_name_the_running_and_waiting_adapters():
    scheduler = Scheduler(lora_config(1), num_kv_blocks=64, eos_token_ids=[])
    worker = FakeWorker(scheduler.block_size)
    for request_id, adapter in (("a0", "a"), ("base", None), ("b0", "b"), ("c0", "c")):
        scheduler.add_request(with_adapter(make_request(request_id, 4, max_tokens=3), adapter))
    step(scheduler, worker)
    stats = scheduler.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (["a"], ["b", "c"])
    assert Scheduler(make_config(), num_kv_blocks=8, eos_token_ids=[]).stats().running_lora_adapters == []


def test_random_mixed_adapter_load_keeps_the_limit_and_finishes_everything():
    """Requests of four adapters and the base arrive over time into a pool small enough to preempt: every step's
    running batch holds at most max_loras adapters, and every request finishes with all its tokens."""
    rng = random.Random(7)
    scheduler = Scheduler(lora_config(2, max_num_batched_tokens=32), num_kv_blocks=8, eos_token_ids=[])
    worker = FakeWorker(scheduler.block_size)
    choices = ["a", "b", "c", "d", None]
    pending = [
        with_adapter(make_request(f"r{i}", rng.randint(2, 12), max_tokens=rng.randint(1, 8)), rng.choice(choices))
        for i in range(40)
    ]
    finished: dict[str, int] = {}
    for _ in range(2000):
        for _ in range(rng.randint(0, 3)):
            if pending:
                assert scheduler.add_request(pending.pop(0)) is None
        if not pending and not scheduler.has_unfinished_requests():
            break
        plan, outputs = step(scheduler, worker)
        assert len(adapters_of(scheduler, [r.request_id for r in scheduler.running])) <= 2
        if plan is not None:
            assert len(adapters_of(scheduler, scheduled_tokens(plan))) <= 2
        for out in outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert len(finished) == 40 and set(finished.values()) == {"length"}
    assert scheduler.counter_totals()[2] > 0, "the pool never ran short: the test lost its preemptions"
