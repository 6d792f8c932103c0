"""Both benchmark scripts end to end on a tiny random checkpoint: they run, and their numbers add up."""

from __future__ import annotations

import json

import bench_serving
import bench_throughput
import pytest

pytestmark = pytest.mark.slow


def only_result(root) -> tuple:
    [folder] = list(root.iterdir())
    return folder, json.loads((folder / "results.json").read_text())


def test_bench_throughput_runs_engine_probe_and_baseline(tiny_checkpoints, tmp_path):
    model = str(tiny_checkpoints("llama"))
    code = bench_throughput.main(
        [
            "--model",
            model,
            "--dtype",
            "float32",
            "--num-prompts",
            "6",
            "--input-len",
            "8:24",
            "--output-len",
            "4:12",
            "--max-num-seqs",
            "4",
            "--probe-input-len",
            "16",
            "--probe-output-len",
            "200",
            "--result-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    folder, data = only_result(tmp_path)
    engine, baseline, probe = data["engine"], data["baseline"], data["decode_probe"]
    assert engine["output_tokens"] == baseline["useful_output_tokens"]  # the same workload on both
    assert 6 * 4 <= engine["output_tokens"] <= 6 * 12
    assert baseline["generated_tokens"] >= baseline["useful_output_tokens"]
    assert engine["num_steps"] > 0 and 0 <= engine["overhead_fraction"] < 1
    assert probe["batch_size"] == 4 and probe["num_steps"] > 100
    assert probe["model_time_s"] <= probe["step_time_s"]
    assert data["roofline"]["batch_size"] == 4 and data["roofline"]["tokens_per_s"] > 0
    assert set(data["targets"]) == {"speedup_vs_transformers", "roofline_fraction", "decode_overhead_fraction"}
    assert (folder / "roofline.png").stat().st_size > 0
    assert (folder / "command.txt").read_text().strip()


def test_bench_serving_sweeps_a_launched_server(tiny_checkpoints, tmp_path):
    model = str(tiny_checkpoints("llama"))
    code = bench_serving.main(
        [
            "--launch",
            "--serve-args",
            f"{model} --dtype float32 --max-num-seqs 4",
            "--tokenizer",
            model,
            "--num-prompts",
            "6",
            "--input-len",
            "8:24",
            "--output-len",
            "4:12",
            "--sweep",
            "1,3",
            "--num-warmup",
            "1",
            "--result-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    folder, data = only_result(tmp_path)
    assert [run["max_concurrency"] for run in data["runs"]] == [1, 3]
    for run in data["runs"]:
        summary = run["summary"]
        assert summary["completed"] == 6 and summary["failed"] == 0
        assert summary["output_len_mismatches"] == 0  # ignore_eos: every request ran to its max_tokens
        assert 6 * 4 <= summary["total_output_tokens"] <= 6 * 12
        assert summary["ttft_ms"]["count"] == 6 and summary["ttft_ms"]["mean"] > 0
    for name in ("latency_cdf.png", "sweep.png", "server.log", "command.txt"):
        assert (folder / name).stat().st_size > 0, name
