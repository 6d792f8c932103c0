"""Workload generation and latency statistics shared by the benchmarks."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from benchlib.results import args_as_json, make_results_dir
from benchlib.stats import format_table, summarize
from benchlib.workload import LengthRange, build_workload


def test_length_range_parses_fixed_and_ranges():
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse("64:512") == LengthRange(64, 512)
    assert LengthRange.parse("64:512").mean == 288
    assert str(LengthRange.parse("64:512")) == "64:512"
    for bad in ("0", "10:5", "abc", "5:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            LengthRange.parse(bad)


def test_workload_lengths_lie_in_range_and_cover_it(smollm2_tokenizer):
    requests = build_workload(smollm2_tokenizer, 200, LengthRange(4, 9), LengthRange(1, 3), seed=1)
    input_lens = {r.input_len for r in requests}
    output_lens = {r.output_len for r in requests}
    assert input_lens == set(range(4, 10))  # uniform over the inclusive range: 200 draws hit every value
    assert output_lens == {1, 2, 3}
    special = set(smollm2_tokenizer.all_special_ids)
    assert not any(special & set(r.prompt_ids) for r in requests)


def test_workload_is_deterministic_per_seed(smollm2_tokenizer):
    a = build_workload(smollm2_tokenizer, 5, LengthRange(8, 16), LengthRange(4, 8), seed=3)
    b = build_workload(smollm2_tokenizer, 5, LengthRange(8, 16), LengthRange(4, 8), seed=3)
    c = build_workload(smollm2_tokenizer, 5, LengthRange(8, 16), LengthRange(4, 8), seed=4)
    assert [(r.prompt_ids, r.output_len) for r in a] == [(r.prompt_ids, r.output_len) for r in b]
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]


def test_text_workload_round_trips_through_the_tokenizer(smollm2_tokenizer):
    for request in build_workload(smollm2_tokenizer, 8, LengthRange(20, 40), LengthRange(4, 4), seed=0, with_text=True):
        assert request.prompt_text
        assert 0 < request.input_len <= 40
        assert smollm2_tokenizer.decode(request.prompt_ids) == request.prompt_text


def test_summarize_matches_numpy():
    values = list(np.random.default_rng(0).exponential(size=1001))
    summary = summarize(values, scale=1e3)
    assert summary["count"] == 1001
    assert summary["mean"] == pytest.approx(1e3 * np.mean(values))
    assert summary["median"] == pytest.approx(1e3 * np.median(values))
    assert summary["p90"] == pytest.approx(1e3 * np.percentile(values, 90))
    assert summary["p99"] == pytest.approx(1e3 * np.percentile(values, 99))
    assert summary["p99"] > summary["p90"] > summary["median"]
    assert np.isnan(summarize([])["mean"])


def test_table_aligns_values_right():
    lines = format_table("t", [("a:", "1.00"), ("longer key:", "123.45")]).splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[1].endswith("1.00") and lines[2].endswith("123.45")


def test_results_folder_records_the_command(tmp_path):
    folder = make_results_dir(tmp_path, "unit")
    assert folder.name.endswith("-unit") and folder.parent == tmp_path
    assert "python" in (folder / "command.txt").read_text()
    args = argparse.Namespace(rate=float("inf"), span=LengthRange(1, 2), n=3)
    assert json.loads(json.dumps(args_as_json(args), allow_nan=False)) == {"rate": "inf", "span": "1:2", "n": 3}


def test_results_folder_records_thread_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder = make_results_dir(tmp_path, "env")
    assert (folder / "command.txt").read_text().startswith("OMP_NUM_THREADS=1 ")
