"""The scheduler benchmarks end to end on a tiny random checkpoint: they run both modes and measure what they claim."""

from __future__ import annotations

import json

import bench_chunked_prefill
import bench_prefix_caching
import bench_priority
import pytest

pytestmark = pytest.mark.slow


def only_result(root) -> tuple:
    [folder] = list(root.iterdir())
    return folder, json.loads((folder / "results.json").read_text())


def serve_args(tiny_checkpoints) -> str:
    return f"{tiny_checkpoints('llama')} --dtype float32 --kv-cache-memory-bytes 64MiB"


def test_prefix_caching_hits_the_shared_prefix_only_when_on(tiny_checkpoints, tmp_path):
    code = bench_prefix_caching.main(
        [
            "--num-requests",
            "4",
            "--prefix-len",
            "64",
            "--suffix-len",
            "8",
            "--max-tokens",
            "2",
            "--serve-args",
            serve_args(tiny_checkpoints),
            "--results-root",
            str(tmp_path),
        ]
    )
    assert code == 0
    folder, data = only_result(tmp_path)
    on, off = data["modes"]["on"], data["modes"]["off"]
    assert on["mean_cached_tokens"] == 64  # the prefix's 4 full blocks, warmed up before the burst
    assert off["mean_cached_tokens"] == 0
    assert on["ttft_ms"]["count"] == off["ttft_ms"]["count"] == 4
    assert data["speedup_mean_ttft"] > 0
    assert {"server-on.log", "server-off.log", "command.txt"} <= {p.name for p in folder.iterdir()}


def test_chunked_prefill_keeps_decodes_stepping_while_the_prompt_prefills(tiny_checkpoints, tmp_path):
    num_streams = 2
    code = bench_chunked_prefill.main(
        [
            "--num-streams",
            str(num_streams),
            "--decode-tokens",
            "128",
            "--tokens-before",
            "2",
            "--long-prompt-len",
            "600",
            "--chunk-budget",
            "64",
            "--max-model-len",
            "1024",
            "--serve-args",
            # the fixed budget's chunks this test counts: the learnt limit beside decoders (tests/scheduler/
            # test_prefill_limit.py) keeps a tiny model's chunks within its replayed 8-token steps, ~100 steps for the
            # prompt, and the 128-token streams could end inside the window
            serve_args(tiny_checkpoints) + " --long-prefill-token-threshold 0",
            "--results-root",
            str(tmp_path),
        ]
    )
    assert code == 0
    _, data = only_result(tmp_path)
    chunked, unchunked = data["modes"]["chunked"], data["modes"]["unchunked"]
    # chunked: the 600-token prompt takes ceil(600 / (64 - 2)) = 10 steps, and each also gives every stream a token.
    # (No such bound holds unchunked: with a tiny model, decode steps also pass while the request crosses the frontend.)
    assert chunked["itl_in_window_ms"]["count"] >= 9 * num_streams
    assert unchunked["itl_in_window_ms"]["count"] >= num_streams
    assert chunked["long_prompt_ttft_s"] > 0 and unchunked["long_prompt_ttft_s"] > 0
    assert chunked["decode_streams_ended_inside_window"] == unchunked["decode_streams_ended_inside_window"] == 0
    assert data["p99_itl_ratio_unchunked_over_chunked"] > 0


def test_priority_policy_serves_high_priority_requests_first(tiny_checkpoints, tmp_path):
    code = bench_priority.main(
        [
            "--max-num-seqs",
            "2",
            "--num-low",
            "8",
            "--low-prompt-len",
            "16",
            "--low-output-len",
            "256:320",
            "--num-high",
            "2",
            "--high-prompt-len",
            "16",
            "--high-output-len",
            "2",
            "--high-start-s",
            "0.2",
            "--high-interval-s",
            "0.05",
            "--serve-args",
            serve_args(tiny_checkpoints),
            "--results-root",
            str(tmp_path),
        ]
    )
    assert code == 0
    _, data = only_result(tmp_path)
    priority, fcfs = data["policies"]["priority"], data["policies"]["fcfs"]
    for policy in (priority, fcfs):
        assert policy["high_ttft_ms"]["count"] == 2 and policy["low_ttft_ms"]["count"] == 8
        # the load saturated the server: low-priority requests were still queued when the high-priority ones came
        assert all(waiting > 0 for waiting in policy["low_waiting_when_high_sent"]), policy
    # under fcfs the high-priority requests wait for the queued low-priority ones; under priority, for one slot
    assert priority["high_ttft_ms"]["mean"] < fcfs["high_ttft_ms"]["mean"], data["policies"]


def test_scheduler_step_bench_times_every_part_of_full_decode_steps():
    import bench_scheduler_step

    medians = bench_scheduler_step.run(batch=16, prompt_len=32, steps=8)
    assert set(medians) == {"schedule", "update", "encode_plan", "decode_result"}  # full-batch decode steps were seen
    assert all(ms > 0 for ms in medians.values())
