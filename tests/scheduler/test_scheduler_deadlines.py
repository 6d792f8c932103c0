"""Deadlines in the scheduler: a request's own deadline ends it with what it has ("length", stop_reason "timeout"),
running or waiting, within one step; --max-queue-time refuses a request that never started, holding no blocks."""

import msgspec

from tests.helpers.sched_testing import EOS, FakeClock, FakeWorker, make_config, make_request, step
from tokenmill.config import SchedulerConfig
from tokenmill.scheduler.scheduler import Scheduler


def make_scheduler(
    num_blocks: int = 64, max_queue_time_s: float = 0.0, **config
) -> tuple[Scheduler, FakeWorker, FakeClock]:
    cfg = make_config(**config)
    cfg = msgspec.structs.replace(
        cfg, scheduler=msgspec.structs.replace(cfg.scheduler, max_queue_time_s=max_queue_time_s)
    )
    clock = FakeClock()
    return Scheduler(cfg, num_blocks, [EOS], clock=clock), FakeWorker(cfg.cache.block_size), clock


def test_a_running_request_past_its_deadline_ends_with_its_tokens_at_the_next_step():
    sched, worker, clock = make_scheduler()
    request = msgspec.structs.replace(make_request("a", 5, max_tokens=50), deadline=clock.now + 2.0)
    assert sched.add_request(request) is None
    sched.add_request(make_request("b", 5, max_tokens=50))
    outputs = [out for _ in range(3) for out in step(sched, worker)[1] if out.request_id == "a"]
    assert [o.new_token_ids for o in outputs] == [[7]] * 3 and outputs[-1].finish_reason is None
    clock.advance(2.0)
    plan, outputs = step(sched, worker)
    ended = [o for o in outputs if o.request_id == "a"]
    assert len(ended) == 1 and ended[0].new_token_ids == []
    assert (ended[0].finish_reason, ended[0].stop_reason) == ("length", "timeout")
    assert ended[0].num_prompt_tokens == 5
    assert "a" in plan.finished_ids and "a" not in sched.requests  # the workers forget it, its blocks are free
    assert [r.request_id for r in sched.running] == ["b"]
    assert sched.kv.req_blocks.get("a") is None


def test_a_waiting_request_past_its_deadline_ends_empty_and_frees_nothing_it_never_had():
    sched, worker, clock = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    sched.add_request(make_request("big", 12, max_tokens=4))
    step(sched, worker)  # "big" holds 3 of the 4 blocks
    late = msgspec.structs.replace(make_request("late", 8, max_tokens=4), deadline=clock.now + 1.0)
    sched.add_request(late)
    step(sched, worker)
    assert [r.request_id for r in sched.waiting] == ["late"]
    used_before = sched.kv.usage
    clock.advance(1.5)
    _, outputs = step(sched, worker)
    ended = [o for o in outputs if o.request_id == "late"]
    assert [(o.finish_reason, o.stop_reason, o.new_token_ids) for o in ended] == [("length", "timeout", [])]
    assert ended[0].queue_time_s == 1.5  # it never left the queue
    assert sched.waiting == [] and sched.kv.usage == used_before


def test_a_request_that_waits_longer_than_max_queue_time_is_refused_with_a_retryable_error():
    sched, worker, clock = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, max_queue_time_s=5.0)
    sched.add_request(make_request("big", 12, max_tokens=4))
    step(sched, worker)
    sched.add_request(make_request("queued", 8, max_tokens=4))
    clock.advance(4.0)
    assert all(o.request_id != "queued" for o in step(sched, worker)[1])  # still within the limit
    clock.advance(1.5)
    _, outputs = step(sched, worker)
    refused = [o for o in outputs if o.request_id == "queued"]
    assert len(refused) == 1 and refused[0].finish_reason == "error" and refused[0].error_kind == "queue_timeout"
    assert "--max-queue-time" in refused[0].error
    assert "queued" not in sched.requests and sched.waiting == []


def test_max_queue_time_spares_a_request_that_started_however_long_it_runs():
    sched, worker, clock = make_scheduler(max_queue_time_s=1.0)
    sched.add_request(make_request("a", 5, max_tokens=20))
    step(sched, worker)
    clock.advance(10.0)
    _, outputs = step(sched, worker)
    assert [o.request_id for o in outputs] == ["a"] and outputs[0].error is None
    assert SchedulerConfig().max_queue_time_s == 0.0  # off unless asked


def test_a_finished_request_s_deadline_does_not_end_a_later_request_with_its_id():
    sched, worker, clock = make_scheduler()
    sched.add_request(msgspec.structs.replace(make_request("a", 5, max_tokens=1), deadline=clock.now + 1.0))
    step(sched, worker)
    assert "a" not in sched.requests  # finished by length
    sched.add_request(make_request("a", 5, max_tokens=3))  # the id again, without a deadline
    clock.advance(2.0)
    _, outputs = step(sched, worker)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", None)]
