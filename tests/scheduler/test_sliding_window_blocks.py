"""Sliding window: with a model whose every layer is windowed, the scheduler frees a running request's blocks as they
slide out of the window, so a long generation holds a bounded number of blocks (read from the pool), and everything
its queries can still see is its own KV, even as the freed blocks go to other requests."""

from __future__ import annotations

from tests.helpers.sched_testing import FakeWorker, make_config, make_request, step
from tokenmill.scheduler.scheduler import Scheduler


class WindowedFakeWorker(FakeWorker):
    """Checks only the KV a windowed model reads: the positions the step's first query can see."""

    def __init__(self, block_size: int, window: int) -> None:
        super().__init__(block_size)
        self.window = window

    def check_and_write_kv(self, state, end):
        first_visible = max(0, state.num_computed_tokens - self.window + 1)
        for position in range(first_visible, state.num_computed_tokens):
            assert self.kv_content.get(self.slot(state, position)) == state.token_ids[position], (
                f"position {position} (in the window) does not hold this request's KV"
            )
        for position in range(state.num_computed_tokens, end):
            self.kv_content[self.slot(state, position)] = state.token_ids[position]


def held_blocks(scheduler: Scheduler) -> int:
    pool = scheduler.kv.pool
    return pool.num_blocks - pool.num_free_blocks


BLOCK_SIZE, WINDOW = 4, 10
BOUND = -(-WINDOW // BLOCK_SIZE) + 1  # ceil(window / block_size) + 1


def test_a_long_generation_holds_bounded_blocks():
    config = make_config(block_size=BLOCK_SIZE, max_model_len=512, max_num_batched_tokens=8)
    scheduler = Scheduler(config, 64, [], sliding_window=WINDOW)
    worker = WindowedFakeWorker(BLOCK_SIZE, WINDOW)
    scheduler.add_request(make_request("long", 23, max_tokens=300))  # a 23-token prompt, in chunks of 8
    held, generated = [], 0
    while scheduler.has_unfinished_requests():
        plan, outputs = step(scheduler, worker)
        generated += sum(len(o.new_token_ids) for o in outputs)
        held.append(held_blocks(scheduler))
        if scheduler.requests:
            req = scheduler.requests["long"]
            if req.num_computed_tokens > req.num_prompt_tokens:  # decoding: one token a step
                assert len(scheduler.kv.req_blocks["long"]) <= BOUND
                assert held_blocks(scheduler) <= BOUND, f"{held_blocks(scheduler)} blocks held after {generated}"
    assert generated == 300  # 323 tokens: 81 blocks without the window, more than the pool holds
    assert max(held) <= BOUND + 1  # a prompt chunk of 8 may span one more block
    assert held_blocks(scheduler) == 0
    assert scheduler.counter_totals()[2] == 0  # no preemption


def test_without_a_window_blocks_grow_with_the_sequence():
    config = make_config(block_size=BLOCK_SIZE, max_model_len=512)
    scheduler = Scheduler(config, 64, [])
    worker = FakeWorker(BLOCK_SIZE)
    scheduler.add_request(make_request("long", 23, max_tokens=60))
    most = 0
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
        most = max(most, held_blocks(scheduler))
    assert most == -(-(23 + 60 - 1) // BLOCK_SIZE)  # every token's block (the last token is never computed)


def test_concurrent_long_generations_share_a_small_pool_without_preemption():
    """Two requests, each generating far more than the pool holds, run side by side on freed blocks."""
    config = make_config(block_size=BLOCK_SIZE, max_model_len=512, max_num_batched_tokens=32)
    scheduler = Scheduler(config, 2 * BOUND + 2, [], sliding_window=WINDOW)
    worker = WindowedFakeWorker(BLOCK_SIZE, WINDOW)
    scheduler.add_request(make_request("a", 9, max_tokens=120))
    scheduler.add_request(make_request("b", 6, max_tokens=120))
    counts = {"a": 0, "b": 0}
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = step(scheduler, worker)
        for out in outputs:
            counts[out.request_id] += len(out.new_token_ids)
        assert held_blocks(scheduler) <= 2 * (BOUND + 1)
    assert counts == {"a": 120, "b": 120}  # 129 tokens each: 33 blocks without the window, the pool has 10
    assert scheduler.counter_totals()[2] == 0, "the window should have kept both within the pool"


def test_prefix_cache_hits_after_the_window_slid_are_valid():
    """A freed block keeps its cached KV until evicted; a later request with the same prompt hits what is intact
    and computes the rest, and the KV its window sees is its own (the fake worker checks)."""
    config = make_config(block_size=BLOCK_SIZE, max_model_len=512, max_num_batched_tokens=64)
    scheduler = Scheduler(config, 40, [], sliding_window=WINDOW)
    worker = WindowedFakeWorker(BLOCK_SIZE, WINDOW)
    prompt = list(range(500, 530))  # 30 tokens: 7 full blocks
    scheduler.add_request(make_request("first", prompt, max_tokens=40))
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    scheduler.add_request(make_request("second", prompt + [1, 2, 3], max_tokens=5))
    plan, _ = step(scheduler, worker)
    assert plan.new_requests[0].num_computed_tokens == 28  # the prompt's full blocks, all still cached
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    # now evict: a third request with other tokens takes every free block, then the same prompt comes back
    scheduler.add_request(make_request("filler", 150, max_tokens=1))
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    scheduler.add_request(make_request("third", prompt, max_tokens=3))
    plan, _ = step(scheduler, worker)
    hit = plan.new_requests[0].num_computed_tokens
    assert hit % BLOCK_SIZE == 0 and hit < 28  # only an intact chain from the first block is a hit
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
