"""Scheduling policies through the Scheduler: FCFS order, priority order and priority preemption, SJF order and
SJF ageing (long jobs are not starved by a stream of short ones)."""

import pytest

from tests.helpers.sched_testing import (
    EOS,
    FakeClock,
    FakeWorker,
    make_config,
    make_request,
    run_to_completion,
    scheduled_tokens,
    step,
)
from tokenmill.scheduler.policy import SjfPolicy, make_policy
from tokenmill.scheduler.scheduler import Scheduler


def make_scheduler(policy: str, num_blocks: int = 64, clock=None, policy_object=None, **config):
    cfg = make_config(policy=policy, **config)
    sched = Scheduler(cfg, num_blocks, [EOS], clock=clock or FakeClock(), policy=policy_object)
    return sched, FakeWorker(cfg.cache.block_size)


def admission_order(sched: Scheduler, worker: FakeWorker) -> list[str]:
    """Run everything to completion and return request ids in the order they were first scheduled."""
    order: list[str] = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched, worker)
        order.extend(n.request_id for n in plan.new_requests if n.request_id not in order)
    return order


def test_fcfs_runs_in_arrival_order():
    sched, worker = make_scheduler("fcfs", max_num_seqs=1)
    for name, size in (("first", 30), ("second", 3), ("third", 10)):
        sched.add_request(make_request(name, size, max_tokens=2, priority=-size))
    assert admission_order(sched, worker) == ["first", "second", "third"]


def test_priority_runs_lower_values_first_then_by_arrival():
    sched, worker = make_scheduler("priority", max_num_seqs=1)
    sched.add_request(make_request("low-1", 4, max_tokens=2, priority=5))
    sched.add_request(make_request("high", 4, max_tokens=2, priority=0))
    sched.add_request(make_request("low-2", 4, max_tokens=2, priority=5))
    sched.add_request(make_request("mid", 4, max_tokens=2, priority=1))
    assert admission_order(sched, worker) == ["high", "mid", "low-1", "low-2"]


def test_higher_priority_arrival_preempts_the_lowest_priority_running_request():
    sched, worker = make_scheduler("priority", num_blocks=6, block_size=4)
    sched.add_request(make_request("low", 10, max_tokens=8, priority=5))  # 3 blocks
    sched.add_request(make_request("lowest", 6, max_tokens=4, priority=9))  # 2 blocks
    step(sched, worker)  # 1 block left; the next step's decodes still fit their blocks
    sched.add_request(make_request("urgent", 8, max_tokens=4, priority=0))  # needs 2 blocks
    plan = sched.schedule()
    assert plan.finished_ids == ["lowest"]  # the worst key goes first; "low" keeps its blocks
    assert [n.request_id for n in plan.new_requests] == ["urgent"]
    assert scheduled_tokens(plan) == {"low": 1, "urgent": 8}  # lowest's decode was taken back
    assert sched.stats().num_preemptions == 1
    sched.update(plan, worker.execute(plan))
    outputs = run_to_completion(sched, worker)
    assert {rid: outs[-1].finish_reason for rid, outs in outputs.items()} == {
        "urgent": "length",
        "low": "length",
        "lowest": "length",
    }
    assert sched.kv.pool.num_free_blocks == 6


def test_equal_priority_arrival_waits_instead_of_preempting():
    sched, worker = make_scheduler("priority", num_blocks=4, block_size=4)
    sched.add_request(make_request("running", 12, max_tokens=4, priority=1))
    step(sched, worker)
    sched.add_request(make_request("same", 8, max_tokens=4, priority=1))
    plan = sched.schedule()
    assert plan.finished_ids == [] and scheduled_tokens(plan) == {"running": 1}


def test_priority_picks_the_lowest_priority_victim_when_running_requests_grow():
    sched, worker = make_scheduler("priority", num_blocks=4, block_size=4, prefix_caching=False)
    sched.add_request(make_request("early-unimportant", [1] * 6, max_tokens=6, priority=3))
    sched.add_request(make_request("late-important", [2] * 6, max_tokens=6, priority=0))
    for _ in range(3):
        step(sched, worker)
    plan = sched.schedule()  # both need a third block, one is free
    assert plan.finished_ids == ["early-unimportant"]  # FCFS would have preempted the later arrival


def test_sjf_runs_the_shortest_expected_work_first():
    sched, worker = make_scheduler("sjf", max_num_seqs=1)
    sched.add_request(make_request("long", 40, max_tokens=10))
    sched.add_request(make_request("short", 4, max_tokens=2))
    sched.add_request(make_request("medium", 10, max_tokens=4))
    assert admission_order(sched, worker) == ["short", "medium", "long"]


@pytest.mark.parametrize("seconds_before_short_arrives, first_admitted", [(1.0, "short"), (5.0, "long")])
def test_sjf_ageing_lets_a_long_waiting_job_overtake_newer_short_ones(seconds_before_short_arrives, first_admitted):
    # work: long = 40 + 10 = 50 tokens, short = 4 + 2 = 6; at 10 tokens/s the long job overtakes a short one that
    # arrived more than 4.4 s after it
    clock = FakeClock()
    sched, worker = make_scheduler("sjf", max_num_seqs=1, clock=clock, policy_object=SjfPolicy(10.0))
    sched.add_request(make_request("occupant", 4, max_tokens=3))
    step(sched, worker)
    sched.add_request(make_request("long", 40, max_tokens=10))
    clock.advance(seconds_before_short_arrives)
    sched.add_request(make_request("short", 4, max_tokens=2))
    order = admission_order(sched, worker)
    assert order[0] == first_admitted


@pytest.mark.parametrize("ageing_rate, starves", [(10.0, False), (1e-9, True)])
def test_sjf_long_job_is_not_starved_by_a_stream_of_short_jobs(ageing_rate, starves):
    clock = FakeClock()
    sched, worker = make_scheduler("sjf", max_num_seqs=1, clock=clock, policy_object=SjfPolicy(ageing_rate))
    sched.add_request(make_request("long", 40, max_tokens=10))
    admitted_long_at = None
    for i in range(60):
        if sum(1 for r in sched.waiting if r.request_id != "long") < 2:
            sched.add_request(make_request(f"short-{i}", 4, max_tokens=2))
        plan, _ = step(sched, worker)
        if any(n.request_id == "long" for n in plan.new_requests):
            admitted_long_at = i
            break
        clock.advance(1.0)
    assert (admitted_long_at is None) == starves


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_policy("lottery")
    with pytest.raises(ValueError):
        SjfPolicy(0.0)
