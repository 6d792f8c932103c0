"""A long prefill beside a decoding request: its chunks shrink while the other decodes, so the decoder's step stays
within 1.5 times its decode-only step (issue 28); the limit is learnt from the workers' step times, or fixed by
--long-prefill-token-threshold."""

import msgspec
import pytest

from tests.helpers.sched_testing import FakeWorker, make_config, make_request, step
from tokenmill.config import SchedulerConfig
from tokenmill.messages import StepPlan, StepResult
from tokenmill.scheduler.prefill_limit import PrefillLimit
from tokenmill.scheduler.scheduler import Scheduler

DECODE_STEP_S = 0.020  # a step's fixed cost: what a decode-only step takes
TOKEN_S = 0.002  # each further token's forward: a decode step costs as much as 10 prefill tokens


class TimedWorker(FakeWorker):
    """A FakeWorker whose steps take DECODE_STEP_S plus TOKEN_S per scheduled token beyond the first."""

    def __init__(self, block_size: int, token_s: float = TOKEN_S) -> None:
        super().__init__(block_size)
        self.token_s = token_s
        self.step_times: list[tuple[dict[str, int], float]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        scheduled = self.state_scheduled(plan)
        model_time_s = DECODE_STEP_S + self.token_s * (sum(scheduled.values()) - 1)
        self.step_times.append((scheduled, model_time_s))
        return msgspec.structs.replace(result, model_time_s=model_time_s)

    @staticmethod
    def state_scheduled(plan: StepPlan) -> dict[str, int]:
        return {n.request_id: n.num_scheduled_tokens for n in plan.new_requests} | {
            r.request_id: r.num_scheduled_tokens for r in plan.running
        }


def with_threshold(threshold: int, **config):
    cfg = make_config(**config)
    scheduler_cfg = msgspec.structs.replace(cfg.scheduler, long_prefill_token_threshold=threshold)
    return msgspec.structs.replace(cfg, scheduler=scheduler_cfg)


def test_the_limit_is_half_a_decode_step_over_a_prefill_tokens_time():
    limit = PrefillLimit()
    assert limit.tokens() is None  # nothing measured: nothing limited
    for _ in range(3):
        limit.observe(num_decodes=2, prefill_cost=0, model_time_s=0.020)
    assert limit.tokens() is None  # the per-token time is still unknown
    limit.observe(num_decodes=1, prefill_cost=50, model_time_s=0.020 + 50 * 0.002)
    # a decode step is worth 10 prefill tokens; a mixed step may add half of one: 5 tokens
    assert limit.decode_step_s() == 0.020 and limit.tokens() == 5
    # one slow step (a core taken away) moves neither median
    limit.observe(num_decodes=2, prefill_cost=0, model_time_s=2.0)
    limit.observe(num_decodes=1, prefill_cost=5, model_time_s=0.030)
    limit.observe(num_decodes=1, prefill_cost=5, model_time_s=0.030)
    assert limit.tokens() == 5
    assert PrefillLimit(threshold=48).tokens() == 48


def test_a_prefill_only_step_counts_its_whole_time_per_token_and_empty_steps_count_nothing():
    limit = PrefillLimit()
    limit.observe(num_decodes=0, prefill_cost=10, model_time_s=0.050)
    limit.observe(num_decodes=0, prefill_cost=0, model_time_s=0.5)
    limit.observe(num_decodes=3, prefill_cost=0, model_time_s=0.0)  # a worker that does not time its steps
    assert limit.prefill_token_s() == 0.005 and limit.decode_step_s() is None


def prompt_beside_a_decoder(sched: Scheduler, worker: TimedWorker, prompt_len: int) -> None:
    """A prefill-only step (the per-token time, roughly), a decoder's first steps, then a prompt of `prompt_len`
    beside it until done; `worker.step_times` holds the prompt's steps."""
    sched.add_request(make_request("warm", 16, max_tokens=1))
    step(sched, worker)
    sched.add_request(make_request("decoder", 4, max_tokens=200, ignore_eos=True))
    for _ in range(6):
        step(sched, worker)
    sched.add_request(make_request("long", prompt_len, max_tokens=1))
    worker.step_times.clear()
    while "long" in sched.requests:
        step(sched, worker)


def test_a_long_prompt_beside_a_decoder_is_chunked_so_the_decoders_step_stays_within_1_5x_its_own():
    cfg = make_config(max_num_batched_tokens=64, max_model_len=512)
    sched, worker = Scheduler(cfg, 256, [2]), TimedWorker(cfg.cache.block_size)
    prompt_beside_a_decoder(sched, worker, 300)
    with_decoder = [seconds for scheduled, seconds in worker.step_times if "decoder" in scheduled]
    assert all(scheduled["decoder"] == 1 for scheduled, _ in worker.step_times)
    # the first mixed step may use the estimate of the prefill-only step (overhead and all); then it is learnt
    # 1.5x, not 2x: a bystander's p99 gap at 2x its idle one by design had no room left for noise
    assert max(with_decoder[2:]) <= 1.5 * DECODE_STEP_S + 1e-9
    assert max(scheduled.get("long", 0) for scheduled, _ in worker.step_times[2:]) >= 3  # not starved to one token


PREFIX_TOKEN_S = 0.0005


class ContextTimedWorker(TimedWorker):
    """A TimedWorker whose prefill tokens cost more the longer the prefix before them (each attends over it): a
    token at position p costs PREFIX_TOKEN_S * (1 + p / 1000), twice as much at 1,000 as at 0 (as on a 2-vCPU AVX2
    host); a decode step is worth 40 of the first tokens."""

    def execute(self, plan: StepPlan) -> StepResult:
        result = FakeWorker.execute(self, plan)
        chunks = [(n.request_id, n.num_computed_tokens, n.num_scheduled_tokens) for n in plan.new_requests]
        chunks += [(r.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in plan.running]
        prefill = [(start, count) for request_id, start, count in chunks if request_id != "decoder"]
        model_time_s = DECODE_STEP_S + sum(
            PREFIX_TOKEN_S * (1 + (start + i) / 1000) for start, count in prefill for i in range(count)
        )
        self.step_times.append((self.state_scheduled(plan), model_time_s))
        return msgspec.structs.replace(result, model_time_s=model_time_s)


def test_a_prompt_whose_tokens_cost_more_as_its_prefix_grows_still_keeps_the_decoder_within_1_55x():
    cfg = make_config(max_num_batched_tokens=64, max_model_len=1024)
    sched, worker = Scheduler(cfg, 512, [2]), ContextTimedWorker(cfg.cache.block_size)
    prompt_beside_a_decoder(sched, worker, 900)
    with_decoder = [seconds for scheduled, seconds in worker.step_times if "decoder" in scheduled]
    assert len(with_decoder) > 30 and max(scheduled.get("long", 0) for scheduled, _ in worker.step_times) >= 16
    # the per-token estimate follows the last few chunks, a step or two behind the growing cost (a median over 32
    # chunks lagged ~16 behind: 1.74x here when a mixed step aimed at 1.6x)
    assert max(with_decoder[2:]) <= 1.55 * DECODE_STEP_S


def test_alone_a_prompt_takes_the_whole_budget():
    cfg = make_config(max_num_batched_tokens=64, max_model_len=512)
    sched, worker = Scheduler(cfg, 256, [2]), TimedWorker(cfg.cache.block_size)
    sched.add_request(make_request("warm", 8, max_tokens=4, ignore_eos=True))
    while "warm" in sched.requests:
        step(sched, worker)
    sched.add_request(make_request("long", 200, max_tokens=1))
    plan, _ = step(sched, worker)
    assert plan is not None and TimedWorker.state_scheduled(plan) == {"long": 64}


def test_a_fixed_threshold_caps_the_prefill_chunks_in_budget_tokens_while_a_request_decodes():
    cfg = with_threshold(12, max_num_batched_tokens=64, max_model_len=512)
    sched = Scheduler(cfg, 256, [2], prompt_logprobs_row_cost=2.0)
    worker = FakeWorker(cfg.cache.block_size)
    sched.add_request(make_request("decoder", 4, max_tokens=100, ignore_eos=True))
    step(sched, worker)
    sched.add_request(make_request("plain", 30, max_tokens=1))
    sched.add_request(make_request("scored", 30, max_tokens=1, prompt_logprobs=1))
    plans = [step(sched, worker)[0] for _ in range(6)]
    scheduled = [TimedWorker.state_scheduled(plan) for plan in plans if plan is not None]
    # 12 plain tokens a step, then the scored prompt at 3 budget tokens a position: 4 positions a step
    assert [s.get("plain") for s in scheduled[:3]] == [12, 12, 6]
    assert [s.get("scored") for s in scheduled[:5]] == [None, None, 2, 4, 4]
    assert all(s["decoder"] == 1 for s in scheduled)


def test_the_flag_reaches_the_scheduler_config():
    from tokenmill.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "m", "--long-prefill-token-threshold", "96"])
    assert config_from_args(args).scheduler.long_prefill_token_threshold == 96
    assert SchedulerConfig().long_prefill_token_threshold is None  # learnt
    assert config_from_args(build_parser().parse_args(["serve", "m"])).scheduler.long_prefill_token_threshold is None
    off = build_parser().parse_args(["serve", "m", "--long-prefill-token-threshold", "0"])
    assert config_from_args(off).scheduler.long_prefill_token_threshold == 0


def test_a_zero_threshold_is_no_limit_as_in_vllm():
    limit = PrefillLimit(threshold=0)
    for _ in range(8):
        limit.observe(num_decodes=1, prefill_cost=0, model_time_s=0.010)
        limit.observe(num_decodes=1, prefill_cost=100, model_time_s=0.110)
    assert limit.tokens() is None
    assert PrefillLimit().tokens() is None  # learnt: nothing known yet


def test_a_learnt_limit_keeps_a_step_within_the_workers_replayed_shape_while_one_could_replay():
    limit = PrefillLimit(replayed_seqs=2, replayed_tokens=8)
    for _ in range(4):
        limit.observe(num_decodes=1, prefill_cost=0, model_time_s=0.020)
        limit.observe(num_decodes=1, prefill_cost=7, model_time_s=0.020 + 7 * 0.001)
    assert PrefillLimit().tokens() is None
    assert limit.tokens(num_decodes=1) == 7  # learnt 10, but 1 decode + 7 prefill tokens is the largest replayed step
    assert limit.tokens(num_decodes=2) == 10  # no sequence left for a replayed step: the learnt limit alone
    assert PrefillLimit(threshold=48, replayed_seqs=2, replayed_tokens=8).tokens(num_decodes=1) == 48  # fixed: as set


def test_the_scheduler_takes_the_replayed_shape_from_its_workers():
    cfg = make_config(max_num_batched_tokens=64, max_model_len=512)
    sched = Scheduler(cfg, 256, [2], replayed_step=(2, 8))
    worker = TimedWorker(cfg.cache.block_size, token_s=0.001)  # cheap prefill tokens: a learnt limit of ~10
    prompt_beside_a_decoder(sched, worker, 100)
    # the learnt limit alone would give the prompt ~10 tokens a step; within the replayed shape it gets 7 beside the
    # decoder, and never more than 8 in all
    totals = [sum(scheduled.values()) for scheduled, _ in worker.step_times]
    assert max(totals) == 8 and all(scheduled["decoder"] == 1 for scheduled, _ in worker.step_times)


def test_each_client_waiting_for_its_prompt_gets_one_share_of_prefill_a_step():
    limit = PrefillLimit(replayed_seqs=2, replayed_tokens=8)
    for _ in range(4):
        limit.observe(num_decodes=1, prefill_cost=0, model_time_s=0.020)
        limit.observe(num_decodes=1, prefill_cost=7, model_time_s=0.020 + 7 * 0.001)
    assert limit.tokens(num_decodes=1, num_prefilling=1) == 7  # one prompt: its single share, in the replayed shape
    assert limit.tokens(num_decodes=1, num_prefilling=4) == 40  # four clients: four shares, past the replayed shape
    assert limit.tokens(num_decodes=3, num_prefilling=2) == 20


def burst_beside_a_decoder(sched: Scheduler, worker: TimedWorker, requests: list) -> list[int]:
    """A decoder's first steps, then `requests` arrive at once; the prefill tokens of each step until they are all
    done decoding their prompts."""
    sched.add_request(make_request("warm", 16, max_tokens=1))
    step(sched, worker)
    sched.add_request(make_request("decoder", 4, max_tokens=400, ignore_eos=True))
    for _ in range(6):
        step(sched, worker)
    for request in requests:
        sched.add_request(request)
    worker.step_times.clear()
    for _ in range(400):
        if set(sched.requests) == {"decoder"}:  # every request of the burst (each choice of n) is done
            break
        step(sched, worker)
    return [sum(n for rid, n in scheduled.items() if rid != "decoder") for scheduled, _ in worker.step_times]


def test_a_burst_of_prompts_beside_a_decoder_gets_a_share_each_but_n_choices_count_once():
    cfg = make_config(max_num_batched_tokens=256, max_model_len=512)
    single = burst_beside_a_decoder(
        Scheduler(cfg, 512, [2]), TimedWorker(cfg.cache.block_size), [make_request("one", 120, max_tokens=1)]
    )
    # the same prompt as one request with n = 2 choices: still one client, one share
    choices = burst_beside_a_decoder(
        Scheduler(cfg, 512, [2]), TimedWorker(cfg.cache.block_size), [make_request("two", 120, max_tokens=1, n=2)]
    )
    burst = [make_request(f"burst{i}", 120, max_tokens=1) for i in range(4)]
    four = burst_beside_a_decoder(Scheduler(cfg, 512, [2]), TimedWorker(cfg.cache.block_size), burst)
    # one learnt share is 5 tokens (a decode step is worth 10 prefill tokens, half of it); the first mixed step may
    # still use the prefill-only estimate
    assert max(single[2:]) <= 5 and max(choices[2:]) <= 5
    assert max(four[2:]) >= 4 * 5  # four clients waiting: four shares a step, not a few tokens each
    # one share a step would take four times the steps of one prompt; the shares shrink as prompts finish (4, 3, 2, 1)
    assert len(four) <= 2 * len(single)


def test_steps_of_a_token_or_two_whose_prefill_cost_nothing_do_not_lift_the_limit():
    """An n = 2 request's second choice recomputes its cached prompt's last token: a step of 1 prefill token whose
    time is a decode step's. Three of them among the last 5 made the plain median 0, and the limit None (none)."""
    limit = PrefillLimit()
    for _ in range(3):
        limit.observe(num_decodes=1, prefill_cost=0, model_time_s=0.020)
    for _ in range(2):
        limit.observe(num_decodes=1, prefill_cost=5, model_time_s=0.020 + 5 * 0.002)
    for _ in range(3):
        limit.observe(num_decodes=1, prefill_cost=1, model_time_s=0.020)
    assert limit.prefill_token_s() == pytest.approx(0.002)  # 10 tokens at 2 ms outweigh 3 at nothing
    assert limit.tokens() == 5
    # measured free only: unbounded by the estimate, still within a replayed step's shape where one could replay
    free = PrefillLimit(replayed_seqs=4, replayed_tokens=8)
    free.observe(num_decodes=1, prefill_cost=0, model_time_s=0.020)
    free.observe(num_decodes=1, prefill_cost=1, model_time_s=0.020)
    assert free.prefill_token_s() == 0.0 and free.tokens(num_decodes=2) == 6
