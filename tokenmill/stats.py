"""Summing the scheduler's `SchedulerStats` reports: the one function behind the server's engine client (running
totals), the data-parallel client (replicas combined) and the offline `LLM` (its `EngineStats`).

A report's counters count what happened since the scheduler's previous report; its gauges (queue sizes, KV usage)
are a snapshot. Summing adds the counters and takes the gauges from one given report.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import zip_longest

import msgspec

from tokenmill.messages import SchedulerStats

# every SchedulerStats field that counts since the last report, except the per-position list (summed apart)
COUNTER_FIELDS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "num_steps",
    "step_time_s",
    "model_time_s",
    "grammar_mask_time_s",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
)


def sum_counters(reports: Iterable[SchedulerStats], gauges: SchedulerStats) -> SchedulerStats:
    """`gauges`'s queue sizes and KV usage with every counter summed over `reports`: the COUNTER_FIELDS, and the
    accepted drafts per position summed position by position (the shorter lists padded with zeros)."""
    reports = list(reports)
    totals: dict[str, object] = {field: sum(getattr(report, field) for report in reports) for field in COUNTER_FIELDS}
    per_pos = zip_longest(*(report.spec_accepted_per_pos for report in reports), fillvalue=0)
    totals["spec_accepted_per_pos"] = [sum(counts) for counts in per_pos]
    return msgspec.structs.replace(gauges, **totals)
