"""Speculative decoding in the scheduler: n-gram proposals, budgeting, verification results, rollback, prefix-cache
hashing of accepted blocks only, stops inside the accepted tokens, preemption with drafts in flight, back-off."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.sched_testing import EOS, make_request
from tests.helpers.spec_decode_testing import NGRAM, PROMPT, TARGET, SpecFakeWorker, make_scheduler, run
from tokenmill.config import SpeculativeConfig
from tokenmill.messages import StructuredOutputsParams
from tokenmill.scheduler.ngram_proposer import NgramProposer, TokenBuffer
from tokenmill.speculative import parse_speculative_config

# ---------------------------------------------------------------- config


def test_parse_ngram_config_defaults_and_values():
    assert parse_speculative_config(None).method is None
    assert parse_speculative_config("").method is None
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        "ngram",
        3,
        5,
        5,
    )
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert config.disable_by_batch_size is None
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 6})
    assert config.disable_by_batch_size == 6


@pytest.mark.parametrize(
    "value, key",
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "'lookahead'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": True}, "'num_speculative_tokens'"),
        ({"method": "ngram"}, "'num_speculative_tokens'"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "'method'"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "'prompt_lookup_min'",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "'prompt_lookup_min'"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "'model'"),
        ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "'disable_by_batch_size'"),
        ('{"method": "ngram", ', "JSON"),
    ],
)
def test_parse_rejects_bad_config_naming_the_key(value, key):
    with pytest.raises(ValueError, match=key):
        parse_speculative_config(value)


def test_parse_draft_model_config():
    config = parse_speculative_config({"model": "/some/dir", "num_speculative_tokens": 3})  # method implied
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/some/dir", 3)
    with pytest.raises(ValueError, match="'prompt_lookup_max' is only used by method 'ngram'"):
        parse_speculative_config(
            {"method": "draft_model", "model": "/d", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
        )


def test_cli_and_llm_arguments_reach_the_engine_config():
    from tokenmill.cli import build_parser, config_from_args
    from tokenmill.llm import _engine_config

    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2}']
    )
    assert config_from_args(args).speculative == SpeculativeConfig(
        method="ngram", num_speculative_tokens=6, prompt_lookup_min=2, prompt_lookup_max=2
    )
    config = _engine_config("", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    assert config.speculative.num_speculative_tokens == 2


# ---------------------------------------------------------------- the proposer


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(2, 3)
    tokens = np.array([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3], dtype=np.int64)
    assert proposer.propose(tokens, 3) == [7, 8, 6]  # "2 3" last seen before 7 (the longer "6 2 3" never)
    assert proposer.propose(tokens, 1) == [7]
    assert proposer.propose(np.array([5, 6, 7, 8], dtype=np.int64), 3) == []
    # the longest suffix wins over a later, shorter one
    tokens = np.array([1, 2, 3, 40, 41, 9, 2, 3, 50, 1, 2, 3], dtype=np.int64)
    assert proposer.propose(tokens, 2) == [40, 41]
    # a match near the end proposes what is there
    assert proposer.propose(np.array([4, 4, 4], dtype=np.int64), 5) == [4]


def test_token_buffer_grows_with_the_request():
    buffer = TokenBuffer()
    tokens = list(range(300))
    assert buffer.sync(tokens[:10]).tolist() == tokens[:10]
    assert buffer.sync(tokens).tolist() == tokens


# ---------------------------------------------------------------- scheduler + a fake target model


@pytest.mark.parametrize("block_size, budget", [(4, 64), (4, 7), (16, 64)])
def test_outputs_match_without_speculation_and_steps_drop(block_size, budget):
    results = {}
    for speculative in (SpeculativeConfig(), NGRAM):
        scheduler = make_scheduler(speculative, block_size=block_size, max_num_batched_tokens=budget)
        worker = SpecFakeWorker(block_size, lambda request_id: TARGET)
        for i in range(3):
            scheduler.add_request(make_request(f"r{i}", PROMPT, max_tokens=30, ignore_eos=False))
        outputs, finish, plans = run(scheduler, worker)
        for plan in plans:  # the budget holds, drafts included
            total = sum(n.num_scheduled_tokens for n in plan.new_requests)
            total += sum(r.num_scheduled_tokens for r in plan.running)
            assert total <= budget
        results[speculative.method] = (outputs, finish, len(plans), worker.drafts_seen, scheduler)
    (plain, plain_finish, plain_steps, _, _), (spec, spec_finish, spec_steps, drafts, scheduler) = (
        results[None],
        results["ngram"],
    )
    assert spec == plain and spec_finish == plain_finish
    assert spec["r0"] == TARGET + [EOS]
    assert drafts and spec_steps < plain_steps
    stats = scheduler.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # some accepted, some rejected
    assert stats.spec_num_drafts == len(drafts)
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert stats.spec_accepted_per_pos == sorted(stats.spec_accepted_per_pos, reverse=True)


def test_stop_inside_the_accepted_tokens_drops_the_rest():
    # EOS and max_tokens land in the middle of a run of accepted drafts
    target = PROMPT[:10] + [EOS] + PROMPT[10:]
    scheduler = make_scheduler()
    worker = SpecFakeWorker(4, lambda request_id: target if request_id == "eos" else PROMPT)
    scheduler.add_request(make_request("eos", PROMPT + PROMPT[:3], max_tokens=40))
    scheduler.add_request(make_request("len", PROMPT + PROMPT[:3], max_tokens=9))
    scheduler.add_request(make_request("stop_id", PROMPT + PROMPT[:3], max_tokens=40, stop_token_ids=[17]))
    outputs, finish, _ = run(scheduler, worker)
    assert outputs["eos"] == PROMPT[:10] + [EOS] and finish["eos"] == "stop"
    assert outputs["len"] == PROMPT[:9] and finish["len"] == "length"
    assert outputs["stop_id"] == PROMPT[:7] and finish["stop_id"] == "stop"
    assert any(len(d) > 1 for _, d in worker.drafts_seen)
    assert not scheduler.kv.req_blocks and scheduler.kv.pool.num_free_blocks == 64


def test_prefix_cache_hashes_only_accepted_blocks():
    """A second request whose prompt is the first one's prompt + outputs hits the blocks the first computed; the fake
    worker checks every hit holds exactly the tokens it should (a block hashed with a rejected draft in it fails)."""
    scheduler = make_scheduler(block_size=4)
    worker = SpecFakeWorker(4, lambda request_id: TARGET)
    scheduler.add_request(make_request("a", PROMPT, max_tokens=22))
    outputs, _, _ = run(scheduler, worker)
    assert outputs["a"] == TARGET
    scheduler.add_request(make_request("b", PROMPT + TARGET[:-1], max_tokens=2))
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == 40  # 10 full blocks found
    worker.execute(plan)  # checks the hit blocks' content


def test_preemption_with_drafts_in_flight():
    """Too few blocks: requests that got drafts earlier in the step are preempted; outputs still match."""
    results = []
    for speculative in (SpeculativeConfig(), NGRAM):
        scheduler = make_scheduler(speculative, num_blocks=14, block_size=4)
        worker = SpecFakeWorker(4, lambda request_id: TARGET)
        for i in range(3):
            scheduler.add_request(make_request(f"r{i}", PROMPT, max_tokens=22))
        outputs, finish, plans = run(scheduler, worker)
        results.append((outputs, finish))
        for plan in plans:
            for run_data in plan.running:
                assert run_data.request_id not in plan.finished_ids
    assert results[0] == results[1]
    assert scheduler.stats().num_preemptions > 0 or scheduler.counter_totals()[2] > 0


def test_requests_that_cannot_speculate_share_the_batch():
    scheduler = make_scheduler()
    worker = SpecFakeWorker(4, lambda request_id: TARGET)
    scheduler.add_request(make_request("plain", PROMPT, max_tokens=20))
    scheduler.add_request(make_request("penalty", PROMPT, max_tokens=20, repetition_penalty=1.2))
    scheduler.add_request(make_request("logprobs", PROMPT, max_tokens=20, logprobs=2))
    scheduler.add_request(make_request("presence", PROMPT, max_tokens=20, presence_penalty=0.5))
    outputs, _, plans = run(scheduler, worker)
    drafted = {request_id for request_id, _ in worker.drafts_seen}
    assert drafted == {"plain"}
    assert all(tokens == TARGET[:20] for tokens in outputs.values())
    assert any(len(p.running) == 4 and any(r.spec_token_ids for r in p.running) for p in plans)


@pytest.mark.parametrize("num_requests", [1, 2, 3, 8])
def test_draft_tokens_per_step_shrink_with_the_batch(num_requests):
    """A step holds at most STEP_TOKEN_BUDGET tokens with its drafts: k drafts alone, fewer with two requests, none
    with more than MAX_SPECULATING_BATCH running (outputs unchanged either way)."""
    from tokenmill.scheduler.spec_decode import MAX_SPECULATING_BATCH, STEP_TOKEN_BUDGET

    k = STEP_TOKEN_BUDGET - 1
    scheduler = make_scheduler(
        SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=4),
        num_blocks=256,
        max_speculating_batch=None,
    )
    worker = SpecFakeWorker(4, lambda request_id: TARGET)
    for i in range(num_requests):
        scheduler.add_request(make_request(f"r{i}", PROMPT, max_tokens=20))
    outputs, _, plans = run(scheduler, worker)
    assert len(outputs) == num_requests and all(tokens == TARGET[:20] for tokens in outputs.values())
    for plan in plans:
        drafts = sum(len(r.spec_token_ids) for r in plan.running)
        assert drafts <= max(0, STEP_TOKEN_BUDGET - len(plan.running) - len(plan.new_requests))
        assert drafts == 0 or len(plan.running) <= MAX_SPECULATING_BATCH
    most = max(sum(len(r.spec_token_ids) for r in plan.running) for plan in plans)
    assert most == (STEP_TOKEN_BUDGET - num_requests if num_requests <= MAX_SPECULATING_BATCH else 0)


def test_structured_output_requests_never_speculate():
    from tokenmill.scheduler.request import Request
    from tokenmill.scheduler.spec_decode import Speculator

    request = make_request("s", PROMPT, structured_outputs=StructuredOutputsParams(regex="a+"))
    assert not Speculator.allowed(Request(request, 0, 0.0, 4))
    assert Speculator.allowed(Request(make_request("t", PROMPT), 0, 0.0, 4))


def test_back_off_when_drafts_are_rejected():
    """A model that always breaks the pattern its history suggests: after each miss the request proposes less
    often, and one token at a time."""
    target = [token for i in range(20) for token in (5, 6, 100 + i)]
    scheduler = make_scheduler()
    worker = SpecFakeWorker(4, lambda request_id: target)
    scheduler.add_request(make_request("r", [5, 6, 3, 4], max_tokens=60))
    outputs, _, plans = run(scheduler, worker)
    assert outputs["r"] == target
    # every proposal after the first few is of one token, and most steps propose none
    drafts = [d for _, d in worker.drafts_seen]
    assert drafts and len(drafts) <= 8, drafts
    assert all(len(d) == 1 for d in drafts[1:])


# ---------------------------------------------------------------- metrics and the log line


def test_metrics_expose_vllm_spec_decode_counters_as_running_totals():
    from tests.helpers.frontend_fakes import FakeEngine
    from tokenmill.frontend.engine_client import AsyncEngineClient
    from tokenmill.frontend.metrics import FrontendMetrics
    from tokenmill.messages import SchedulerStats

    engine = FakeEngine()
    for report in ([3, 1], [2, 2, 1]):  # per-position counts grow with k between reports
        stats = SchedulerStats(
            1,
            0,
            0.1,
            0,
            0,
            0,
            spec_num_drafts=4,
            spec_num_draft_tokens=9,
            spec_num_accepted_tokens=sum(report),
            spec_accepted_per_pos=report,
        )
        AsyncEngineClient._accumulate(engine, stats)  # type: ignore[arg-type]
    text = FrontendMetrics(engine, "m").render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 8.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 18.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 5.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text
    engine.latest_stats = SchedulerStats(1, 0, 0.1, 0, 0, 0)  # speculation off: no spec_decode series at all
    assert "spec_decode" not in FrontendMetrics(engine, "m").render().decode()


def test_log_line_reports_acceptance_rate_and_length():
    from tokenmill.messages import SchedulerStats
    from tokenmill.scheduler.spec_decode import SpecDecodeLogger

    class Log:
        lines: list[str] = []

        def info(self, fmt, line):
            self.lines.append(line)

    now = [0.0]
    logger = SpecDecodeLogger(Log(), interval_s=10, clock=lambda: now[0])
    stats = SchedulerStats(
        1,
        0,
        0.1,
        0,
        0,
        0,
        spec_num_drafts=10,
        spec_num_draft_tokens=40,
        spec_num_accepted_tokens=20,
        spec_accepted_per_pos=[8, 6, 4, 2],
    )
    assert logger.observe(stats) is None  # not due yet
    now[0] = 10.0
    line = logger.observe(stats)
    assert "Mean acceptance length: 3.00" in line and "Avg Draft acceptance rate: 50.0%" in line
    assert "Per-position acceptance rate: 0.800, 0.600, 0.400, 0.200" in line  # 16 of 20 drafts, ...
