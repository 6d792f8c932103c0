"""The dashboard's feed from the scheduler: per-step records, the block map, queue entries, sampling and throttling."""

from __future__ import annotations

import msgspec
import pytest

from tests.helpers.sched_testing import FakeClock, FakeWorker, make_config, make_request, step
from tokenmill.messages import SchedulerMessage, StepSummary, decoder, encode
from tokenmill.scheduler.block_pool import BLOCK_CACHED, BLOCK_FREE, BLOCK_IN_USE, BlockPool
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.scheduler.step_summary import (
    FIRST_COLOR,
    HISTORY_STEPS,
    MAX_BACKOFF_S,
    MAX_DUTY,
    MAX_QUEUE_ENTRIES,
    StepSummarizer,
    request_color,
    split_tokens,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def summarizer(clock=None) -> tuple[StepSummarizer, list[StepSummary]]:
    sent: list[StepSummary] = []
    # summaries cost no CPU time here, so only the interval spaces them
    return StepSummarizer(sent.append, clock=clock or Clock(), wall_clock=lambda: 1.7e9, cpu_clock=lambda: 0.0), sent


def engine(num_blocks: int = 16, **config) -> tuple[Scheduler, FakeWorker]:
    cfg = make_config(**config)
    return Scheduler(cfg, num_blocks, [2], clock=FakeClock()), FakeWorker(cfg.cache.block_size)


def run_step(sched: Scheduler, worker: FakeWorker, summaries: StepSummarizer):
    plan, outputs = step(sched, worker)
    assert plan is not None
    summaries.record(plan, 0.01, sched.counter_totals()[2])
    return plan, outputs


def check_map_against_pool(summary: StepSummary, sched: Scheduler) -> None:
    pool = sched.kv.pool
    block_map = summary.block_map
    assert len(block_map) == pool.num_blocks == summary.num_blocks
    for block in pool.blocks:
        code = block_map[block.block_id]
        if block.ref_count > 0:
            assert code >= BLOCK_IN_USE
        elif block.hash is not None:
            assert code == BLOCK_CACHED
        else:
            assert code == BLOCK_FREE
    assert summary.num_free_blocks == pool.num_free_blocks
    assert summary.num_cached_blocks == sum(1 for b in pool.blocks if b.ref_count == 0 and b.hash is not None)
    assert summary.kv_cache_usage == pytest.approx((pool.num_blocks - pool.num_free_blocks) / pool.num_blocks)


def test_the_pool_state_follows_every_block_move():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    assert list(pool.state) == [BLOCK_IN_USE] * 3 + [BLOCK_FREE] * 3
    pool.cache(blocks[0], b"h0", (0, (1, 2), None))
    pool.free(blocks)
    assert list(pool.state) == [BLOCK_CACHED, BLOCK_FREE, BLOCK_FREE] + [BLOCK_FREE] * 3
    pool.touch([blocks[0]])  # a prefix-cache hit takes the cached block back
    assert pool.state[0] == BLOCK_IN_USE
    pool.free([blocks[0]])
    assert pool.state[0] == BLOCK_CACHED
    taken = pool.allocate(6)  # evicts the cached block too
    assert list(pool.state) == [BLOCK_IN_USE] * 6 and blocks[0] in taken


def test_split_tokens_tells_prefill_from_decode():
    sched, worker = engine(max_num_batched_tokens=8, block_size=4)
    sched.add_request(make_request("long", 20, max_tokens=3))  # chunked over three steps
    summaries, _ = summarizer()
    plan, _ = run_step(sched, worker, summaries)
    assert split_tokens(plan) == (8, 0)
    sched.add_request(make_request("short", 3, max_tokens=5))
    seen = []
    for _ in range(6):
        plan, _ = run_step(sched, worker, summaries)
        seen.append(split_tokens(plan))
    # long: 8 more, then its last 4 prompt tokens with short's 3, then both decode until long's 3 tokens are out
    assert seen == [(8, 0), (4 + 3, 0), (0, 2), (0, 2), (0, 1), (0, 1)]
    records = list(summaries.history)
    assert [r[0] for r in records] == list(range(7))
    assert [(r[1], r[2]) for r in records[1:]] == seen
    assert [r[3] for r in records] == [1, 1, 2, 2, 2, 1, 1]  # requests in each batch


def test_nothing_is_sent_until_watched_and_then_at_most_every_interval():
    clock = Clock()
    summaries, sent = summarizer(clock)
    sched, worker = engine()
    sched.add_request(make_request("a", 6, max_tokens=20))
    for _ in range(3):
        run_step(sched, worker, summaries)
        assert not summaries.maybe_publish(sched)
    assert sent == []
    summaries.watch(0.05)
    assert summaries.maybe_publish(sched)  # at once: the history so far
    assert [r[0] for r in sent[0].steps] == [0, 1, 2]
    run_step(sched, worker, summaries)
    assert not summaries.maybe_publish(sched)  # not due yet
    clock.now += 0.05
    run_step(sched, worker, summaries)
    assert summaries.maybe_publish(sched)
    assert [r[0] for r in sent[1].steps] == [3, 4]  # every step since the last summary, none twice
    summaries.watch(0)
    clock.now += 1
    run_step(sched, worker, summaries)
    assert not summaries.maybe_publish(sched) and len(sent) == 2


def test_a_slow_summary_spaces_out_the_next_ones():
    class SlowClock(Clock):
        step = 0.001  # every reading this much later: a summary "takes" 1 ms of CPU time

        def __call__(self) -> float:
            self.now += self.step
            return self.now

    clock, cpu = Clock(), SlowClock()
    sent: list[StepSummary] = []
    summaries = StepSummarizer(sent.append, clock=clock, cpu_clock=cpu)
    sched, _ = engine()
    summaries.watch(0.05)
    assert summaries.maybe_publish(sched)
    assert summaries.next_due - clock.now == pytest.approx(0.001 / MAX_DUTY)  # 1 ms of work: 0.2 s apart, not 0.05
    assert summaries.summary_time_s == pytest.approx(0.001)
    cpu.step = 0.1  # a summary that cost 100 ms still leaves the next one due within MAX_BACKOFF_S
    clock.now = summaries.next_due
    assert summaries.maybe_publish(sched)
    assert summaries.next_due - clock.now == pytest.approx(MAX_BACKOFF_S)


def test_the_summary_maps_blocks_and_lists_the_queues():
    sched, worker = engine(num_blocks=12, block_size=4, max_num_seqs=2)
    shared = list(range(500, 508))  # two full blocks every request starts with
    for i, priority in enumerate((0, 3, 1)):
        sched.add_request(make_request(f"r{i}", shared + [900 + i], max_tokens=6, priority=priority))
    summaries, sent = summarizer()
    summaries.watch(0.05)
    run_step(sched, worker, summaries)
    summaries.maybe_publish(sched)
    summary = sent[-1]
    check_map_against_pool(summary, sched)
    assert (summary.num_running, summary.num_waiting) == (2, 1)
    running = [e for e in summary.queue if e.running]
    waiting = [e for e in summary.queue if not e.running]
    assert [e.request_id for e in running] == ["r0", "r1"] and [e.request_id for e in waiting] == ["r2"]
    assert running[0].prompt_computed == running[0].prompt_tokens == 9 and running[0].output_tokens == 1
    assert running[1].priority == 3 and waiting[0].priority == 1
    assert waiting[0].color == 0 and waiting[0].prompt_computed == 0
    for entry in running:  # every block a running request holds carries its color (a shared one: some owner's)
        assert entry.color == request_color(sched.requests[entry.request_id].arrival_seq) >= FIRST_COLOR
        own = [b.block_id for b in sched.kv.req_blocks[entry.request_id] if b.ref_count == 1]
        assert own and all(summary.block_map[b] == entry.color for b in own)
    # the message survives the socket's codec
    decoded = decoder(SchedulerMessage).decode(encode(summary))
    assert decoded == summary

    while sched.has_unfinished_requests():
        run_step(sched, worker, summaries)
    summaries.summary_time_s = 0.0
    summaries.next_due = 0.0
    summaries.maybe_publish(sched)
    idle = sent[-1]
    check_map_against_pool(idle, sched)
    assert idle.queue == [] and idle.kv_cache_usage == 0.0
    assert idle.num_cached_blocks >= 2  # the shared prefix stays cached after everything finished
    queries, hits, _ = sched.counter_totals()
    assert (idle.prefix_cache_queries, idle.prefix_cache_hits) == (queries, hits) and hits >= 8


def test_preemptions_are_counted_on_the_step_that_made_them_and_survive_stats_reports():
    sched, worker = engine(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    for i in range(3):
        sched.add_request(make_request(f"p{i}", 7, max_tokens=12, ignore_eos=True))
    summaries, sent = summarizer()
    while sched.has_unfinished_requests():
        run_step(sched, worker, summaries)
        sched.stats()  # the process reports stats now and then: the totals must not lose what it reset
    per_step = sum(r[5] for r in summaries.history)
    assert per_step > 0
    assert per_step == sched.counter_totals()[2]
    assert any(r[5] > 0 for r in summaries.history)


def test_the_queue_list_is_capped_and_the_history_bounded():
    sched, worker = engine(num_blocks=8, block_size=4, max_num_seqs=2)
    for i in range(MAX_QUEUE_ENTRIES + 10):
        sched.add_request(make_request(f"q{i}", 3, max_tokens=2))
    summaries, sent = summarizer()
    summaries.watch(0.05)
    summaries.maybe_publish(sched)
    summary = sent[-1]
    assert len(summary.queue) == MAX_QUEUE_ENTRIES and summary.num_waiting == MAX_QUEUE_ENTRIES + 10
    for _ in range(HISTORY_STEPS + 5):
        if not sched.has_unfinished_requests():
            break
        run_step(sched, worker, summaries)
    assert len(summaries.history) <= HISTORY_STEPS


def test_the_json_view_is_what_the_schema_says(tmp_path):
    from tokenmill.frontend.dashboard import summary_json

    sched, worker = engine(num_blocks=10, block_size=4)
    sched.add_request(make_request("j", 9, max_tokens=3))
    summaries, sent = summarizer()
    summaries.watch(0.05)
    run_step(sched, worker, summaries)
    summaries.maybe_publish(sched)
    view = msgspec.json.decode(summary_json(sent[-1], {"time": 1.0}, "m"))
    assert set(view) == {
        "engine",
        "model",
        "step_id",
        "time",
        "steps",
        "num_running",
        "num_waiting",
        "queue",
        "blocks",
        "prefix_cache",
        "num_preemptions",
        "summary_time_s",
        "frontend",
    }
    assert view["steps"][0] == {
        "step_id": 0,
        "prefill_tokens": 9,
        "decode_tokens": 0,
        "num_requests": 1,
        "step_time_s": 0.01,
        "preemptions": 0,
    }
    blocks = view["blocks"]
    import base64

    raw = base64.b64decode(blocks["map"])
    assert len(raw) == blocks["num_blocks"] == 10
    assert blocks["free"] == raw.count(0) and blocks["cached"] == raw.count(1)
    assert blocks["used"] == sum(1 for code in raw if code >= 2) == 3  # the 9 prompt tokens' 3 blocks
    assert blocks["free"] + blocks["cached"] + blocks["used"] == 10
    assert view["queue"][0]["status"] == "running" and view["queue"][0]["output_tokens"] == 1
