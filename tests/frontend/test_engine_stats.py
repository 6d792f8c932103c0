"""Scheduler stats are summed by one function (`tokenmill.stats.sum_counters`) for the server's engine client, the
data-parallel client and the offline `LLM`: fed the same reports, the three report the same totals."""

from __future__ import annotations

from collections.abc import Iterator

from tokenmill.config import EngineConfig
from tokenmill.frontend.data_parallel_client import DataParallelEngineClient
from tokenmill.frontend.engine_client import AsyncEngineClient
from tokenmill.llm import LLM, EngineStats
from tokenmill.messages import SchedulerStats, StepOutputs

# times are binary fractions, so sums are exact in any order
REPORTS = [
    SchedulerStats(
        2,
        1,
        0.25,
        16,
        8,
        0,
        num_steps=3,
        step_time_s=0.5,
        model_time_s=0.25,
        grammar_mask_time_s=1 / 64,
        spec_num_drafts=2,
        spec_num_draft_tokens=5,
        spec_num_accepted_tokens=3,
        spec_accepted_per_pos=[2, 1],
    ),
    SchedulerStats(
        1,
        0,
        0.5,
        4,
        4,
        1,
        num_steps=2,
        step_time_s=0.25,
        model_time_s=0.125,
        grammar_mask_time_s=1 / 32,
        spec_num_drafts=1,
        spec_num_draft_tokens=3,
        spec_num_accepted_tokens=3,
        spec_accepted_per_pos=[1, 1, 1],
    ),
    SchedulerStats(0, 0, 0.0, 0, 0, 0, num_steps=1, step_time_s=0.125, model_time_s=1 / 16, grammar_mask_time_s=1 / 16),
]


def client_totals(config: EngineConfig) -> SchedulerStats | None:
    client = AsyncEngineClient(config)
    try:
        for report in REPORTS:
            client._accumulate(report)
        return client.latest_stats
    finally:
        client.close()


def data_parallel_totals(config: EngineConfig) -> SchedulerStats | None:
    """Two replicas, the reports dealt alternately between them."""
    client = DataParallelEngineClient([config, config], [lambda: None, lambda: None])
    try:
        for i, report in enumerate(REPORTS):
            client.replicas[i % 2]._accumulate(report)
        return client.latest_stats
    finally:
        client.close()


def offline_totals() -> EngineStats:
    """The LLM's own step-output handling, fed the reports without starting its processes."""
    llm = object.__new__(LLM)
    llm._stats_totals = None
    llm.step_listener = llm.summary_listener = None
    messages: Iterator[StepOutputs] = iter(StepOutputs([], report) for report in REPORTS)
    llm._receive = lambda: next(messages)  # type: ignore[method-assign]
    for _ in REPORTS:
        llm._step_outputs()
    return llm.engine_stats()


def test_server_data_parallel_and_offline_totals_agree(tmp_path):
    config = EngineConfig(ipc_dir=str(tmp_path))
    single, replicas, offline = client_totals(config), data_parallel_totals(config), offline_totals()
    assert single is not None and replicas is not None
    assert single.grammar_mask_time_s == replicas.grammar_mask_time_s == offline.grammar_mask_time_s
    assert offline.grammar_mask_time_s == 7 / 64
    for totals in (single, replicas):
        assert EngineStats.from_totals(totals) == offline
        assert (totals.prefix_cache_queries, totals.prefix_cache_hits, totals.num_preemptions) == (20, 12, 1)
        assert totals.spec_accepted_per_pos == [3, 2, 1]
    assert (offline.num_steps, offline.spec_num_drafts, offline.spec_num_accepted_tokens) == (6, 3, 6)
    # gauges: the newest report for one engine; the replicas' newest, summed (KV usage averaged), for data parallel
    assert (single.num_running, single.kv_cache_usage) == (0, 0.0)
    assert (replicas.num_running, replicas.num_waiting, replicas.kv_cache_usage) == (1, 0, 0.25)
