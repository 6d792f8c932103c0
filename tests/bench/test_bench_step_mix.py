"""scripts/bench_step_mix.py on a tiny random checkpoint: every mix runs, and its step split adds up."""

from __future__ import annotations

import bench_step_mix
import pytest

pytestmark = pytest.mark.slow


def test_every_mix_runs_and_only_the_structured_one_fills_masks(tiny_checkpoints, capsys):
    model = str(tiny_checkpoints("llama"))
    assert bench_step_mix.main(["--model", model, "--max-tokens", "24", "--rounds", "1", "--max-logit-bias", "64"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    by_mix = {cells[1].strip(): [float(cell) for cell in cells[2:]] for cells in rows}
    assert set(by_mix) == set(bench_step_mix.mixes(24, 64, 256))
    for name, (gap_median, gap_p99, model_ms, mask_ms, rest_ms) in by_mix.items():
        assert 0 < gap_median <= gap_p99 and model_ms > 0 and rest_ms >= 0
        assert (mask_ms > 0) == (name == "1 greedy + 1 structured"), name
