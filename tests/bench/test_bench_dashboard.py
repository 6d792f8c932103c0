"""scripts/bench_dashboard.py end to end on a tiny random checkpoint: both modes run, and only "on" gets summaries."""

from __future__ import annotations

import json

import bench_dashboard
import pytest

pytestmark = pytest.mark.slow


def test_summaries_flow_only_when_watched_and_their_cost_is_reported(tiny_checkpoints, tmp_path):
    code = bench_dashboard.main(
        [
            "--model",
            str(tiny_checkpoints("llama")),
            "--batch",
            "4",
            "--prompt-len",
            "24",
            "--max-tokens",
            "40",
            "--rounds",
            "2",
            "--interval",
            "0.001",
            "--kv-cache-memory-bytes",
            str(16 << 20),
            "--max-model-len",
            "128",
            "--results-root",
            str(tmp_path),
        ]
    )
    assert code == 0
    [folder] = list(tmp_path.iterdir())
    data = json.loads((folder / "results.json").read_text())
    on, off = data["rounds"]["on"], data["rounds"]["off"]
    assert len(on) == len(off) == 2
    assert all(r["summaries"] == 0 for r in off)
    # a 1 ms interval, but the duty cap spaces summaries by their cost (a few ms for 40 steps of ~1.5 ms each): a
    # handful per round, each listing the batch
    assert all(r["summaries"] >= 3 and r["max_batch_seen"] == 4 for r in on)
    assert all(r["steps"] >= 40 for r in on + off)
    assert data["summary_cpu_ms_per_step"] > 0 and 0 < data["summary_fraction_of_step"] < 0.5
    assert data["ratio_on_off"] > 0 and data["micro"]["record_us"] > 0 and data["micro"]["batch"] == 4
