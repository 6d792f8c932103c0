"""Offline throughput of `LLM.generate` against transformers' static batching, with the engine's step overhead
and a decode roofline, all measured in one run.

1. Machine peaks (fp32 matmul FLOP/s, copy bandwidth) for the roofline, measured before anything else runs.
2. tokenmill: N random prompts (input lengths uniform in --input-len, max_tokens uniform in --output-len,
   ignore_eos) through one `LLM.generate` call with --max-num-seqs running at once. Reports throughput, the
   scheduler + messaging share of step time over the whole run, and per-request TPOT.
3. A decode probe: --max-num-seqs prompts of one length decoded together; the steps where all of them decode
   (and nothing else runs) give the decode step time at that batch size, its overhead, and the achieved decode
   tokens/s as a fraction of the roofline bound.
4. transformers `generate` on the same weights and dtype, static left-padded batches of --max-num-seqs requests,
   counting only each request's own max_tokens as useful output.

    python scripts/bench_throughput.py --num-prompts 128 --input-len 64:512 --output-len 16:256 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

import torch
from benchlib.hf_baseline import BaselineRun, load_hf_model, run_static_batches
from benchlib.results import args_as_json, make_results_dir, save_json
from benchlib.stats import format_table, summarize
from benchlib.step_timing import DecodeWindow, StepRecorder, WindowTooShort
from benchlib.workload import BenchRequest, LengthRange, build_workload
from roofline import MachinePeaks, ModelCost, decode_bound, measure_machine, plot_roofline

TARGET_SPEEDUP = 2.0
TARGET_ROOFLINE_FRACTION = 0.5
TARGET_OVERHEAD_FRACTION = 0.05


def sampling_params(request: BenchRequest):
    from tokenmill import SamplingParams

    return SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0)


def run_tokenmill(llm, requests: list[BenchRequest]) -> dict:
    """One timed `generate` over the workload; its throughput, step overhead and per-request TPOT."""
    recorder = StepRecorder()
    llm.step_listener = recorder
    before = llm.engine_stats()
    started = time.perf_counter()
    results = llm.generate([r.prompt_ids for r in requests], [sampling_params(r) for r in requests])
    elapsed = time.perf_counter() - started
    llm.step_listener = None
    stats = llm.engine_stats().since(before)
    short = [
        (len(res.outputs[0].token_ids), req.output_len)
        for res, req in zip(results, requests)
        if len(res.outputs[0].token_ids) != req.output_len
    ]
    if short:
        raise RuntimeError(f"{len(short)} requests did not generate their max_tokens (got, wanted): {short[:5]}")
    input_tokens = sum(r.input_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {
        "elapsed_s": elapsed,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(requests) / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_token_throughput": (input_tokens + output_tokens) / elapsed,
        "num_steps": stats.num_steps,
        "mean_step_time_ms": 1e3 * stats.step_time_s / max(1, stats.num_steps),
        "overhead_per_step_ms": 1e3 * stats.overhead_time_s / max(1, stats.num_steps),
        "overhead_fraction": stats.overhead_fraction,
        "tpot_ms": summarize(recorder.tpots_s(), 1e3),
    }


def run_decode_probe(
    llm, tokenizer, batch_size: int, input_len: int, output_len: int, seed: int
) -> tuple[DecodeWindow, int]:
    """Decode `batch_size` equal-length requests together and time the steps where all of them decode; returns the
    timing and the output length it took.

    The scheduler reports stats every half second, so on fast hardware a short probe may hold no report to time:
    then it is run again with four times the output length, as far as the model's context allows."""
    while True:
        requests = build_workload(
            tokenizer, batch_size, LengthRange(input_len, input_len), LengthRange(output_len, output_len), seed
        )
        recorder = StepRecorder()
        llm.step_listener = recorder
        results = llm.generate([r.prompt_ids for r in requests], [sampling_params(r) for r in requests], use_tqdm=False)
        llm.step_listener = None
        try:
            return recorder.decode_window({result.request_id for result in results}), output_len  # n=1: one id
        except WindowTooShort:
            longer = min(4 * output_len, llm.engine_info.max_model_len - input_len)
            if longer <= output_len:
                raise
            print(f"decode probe: {output_len} tokens were too few to time, trying {longer}", file=sys.stderr)
            output_len, seed = longer, seed + 1


def run_baseline(config, dtype: str, requests: list[BenchRequest], batch_size: int, pad_id: int) -> BaselineRun:
    model = load_hf_model(config.model.path, config.model.gguf_file, getattr(torch, dtype))
    try:
        return run_static_batches(model, requests, batch_size, pad_id)
    finally:
        del model


def report(
    args, machine: MachinePeaks, engine: dict, probe: DecodeWindow, bound, baseline: BaselineRun | None, engine_info
) -> tuple[str, dict]:
    achieved = probe.batch_size / probe.wall_step_time_s
    rows = [
        ("Model / dtype / device:", f"{engine_info.architecture} / {engine_info.dtype} / {engine_info.device}"),
        ("Machine fp32 matmul (GFLOP/s):", f"{machine.matmul_flops / 1e9:.1f}"),
        ("Machine copy bandwidth (GB/s):", f"{machine.copy_bandwidth / 1e9:.2f}"),
        ("tokenmill elapsed (s):", f"{engine['elapsed_s']:.1f}"),
        ("tokenmill requests/s:", f"{engine['request_throughput']:.3f}"),
        ("tokenmill output tokens/s:", f"{engine['output_throughput']:.1f}"),
        ("tokenmill total tokens/s:", f"{engine['total_token_throughput']:.1f}"),
        ("tokenmill mean TPOT (ms):", f"{engine['tpot_ms']['mean']:.1f}"),
        ("tokenmill steps / mean step (ms):", f"{engine['num_steps']} / {engine['mean_step_time_ms']:.1f}"),
        (
            "Step overhead, whole run (ms, share):",
            f"{engine['overhead_per_step_ms']:.2f}, {engine['overhead_fraction']:.2%}",
        ),
    ]
    targets = {}
    if baseline is not None:
        speedup = engine["output_throughput"] / baseline.output_throughput
        rows += [
            ("transformers elapsed (s):", f"{baseline.elapsed_s:.1f}"),
            ("transformers useful output tokens/s:", f"{baseline.output_throughput:.1f}"),
            (
                "transformers generated / useful tokens:",
                f"{baseline.generated_tokens} / {baseline.useful_output_tokens}",
            ),
            ("Speedup over transformers (output tok/s):", f"{speedup:.2f}x"),
        ]
        targets["speedup_vs_transformers"] = {
            "value": speedup,
            "target": TARGET_SPEEDUP,
            "met": speedup >= TARGET_SPEEDUP,
        }
    rows += [
        ("Decode probe batch / context:", f"{probe.batch_size} / {bound.context_len:.0f}"),
        ("Decode step, client wall (ms):", f"{probe.wall_step_time_s * 1e3:.1f}"),
        ("Decode step, scheduler / model (ms):", f"{probe.step_time_s * 1e3:.1f} / {probe.model_time_s * 1e3:.1f}"),
        ("Decode overhead per step (ms, share):", f"{probe.overhead_s * 1e3:.2f}, {probe.overhead_fraction:.2%}"),
        ("Decode loop overhead incl. publish (share):", f"{probe.loop_overhead_fraction:.2%}"),
        ("Roofline bound (tokens/s, limited by):", f"{bound.tokens_per_s:.1f}, {bound.limited_by}"),
        ("Achieved decode tokens/s:", f"{achieved:.1f}"),
        ("Fraction of roofline bound:", f"{achieved / bound.tokens_per_s:.1%}"),
    ]
    targets["roofline_fraction"] = {
        "value": achieved / bound.tokens_per_s,
        "target": TARGET_ROOFLINE_FRACTION,
        "met": achieved / bound.tokens_per_s >= TARGET_ROOFLINE_FRACTION,
    }
    targets["decode_overhead_fraction"] = {
        "value": probe.overhead_fraction,
        "target": TARGET_OVERHEAD_FRACTION,
        "met": probe.overhead_fraction < TARGET_OVERHEAD_FRACTION,
    }
    title = (
        f"Offline throughput: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
        f"max batch {args.max_num_seqs}"
    )
    data = {
        "machine": asdict(machine),
        "engine": engine,
        "decode_probe": {
            **asdict(probe),
            "overhead_s": probe.overhead_s,
            "overhead_fraction": probe.overhead_fraction,
            "loop_overhead_fraction": probe.loop_overhead_fraction,
            "achieved_tokens_per_s": achieved,
        },
        "roofline": asdict(bound),
        "baseline": asdict(baseline) if baseline else None,
        "baseline_output_throughput": baseline.output_throughput if baseline else None,
        "targets": targets,
    }
    return format_table(title, rows), data


def report_data_parallel(args, engine: dict, engine_info, folder) -> int:
    rows = [
        ("Model / dtype / device:", f"{engine_info.architecture} / {engine_info.dtype} / {engine_info.device}"),
        ("Data-parallel replicas:", str(args.data_parallel_size)),
        ("tokenmill elapsed (s):", f"{engine['elapsed_s']:.1f}"),
        ("tokenmill requests/s:", f"{engine['request_throughput']:.3f}"),
        ("tokenmill output tokens/s:", f"{engine['output_throughput']:.1f}"),
        ("tokenmill total tokens/s:", f"{engine['total_token_throughput']:.1f}"),
        ("tokenmill mean TPOT (ms):", f"{engine['tpot_ms']['mean']:.1f}"),
    ]
    print(
        format_table(
            f"Offline throughput, {args.data_parallel_size} replicas: {args.num_prompts} prompts, input "
            f"{args.input_len}, output {args.output_len}, max batch {args.max_num_seqs} each",
            rows,
        )
    )
    save_json(folder, {"engine": engine, "config": args_as_json(args)})
    print(f"results in {folder}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help='as for `tokenmill serve` ("" = the default model)')
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=LengthRange.parse, default=LengthRange(64, 512))
    parser.add_argument("--output-len", type=LengthRange.parse, default=LengthRange(16, 256))
    parser.add_argument("--max-num-seqs", type=int, default=32, help="engine max batch = baseline batch size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--probe-input-len", type=int, default=None, help="default: the middle of --input-len")
    parser.add_argument("--probe-output-len", type=int, default=64)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the engine worker and the baseline alike (default: torch's choice)",
    )
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind the LLM's router; above 1 the decode probe and roofline (one "
        "engine's step) are skipped",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", default="bench_results")
    parser.add_argument("--name", default="throughput")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from tokenmill import LLM
    from tokenmill.workers.model_loader import load_hf_config

    args = parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine's spawned worker reads it at start-up
        torch.set_num_threads(args.threads)  # this process: the roofline measurement and the baseline
    folder = make_results_dir(args.result_dir, args.name)
    print("measuring the machine's matmul FLOP/s and copy bandwidth ...", file=sys.stderr)
    machine = measure_machine()

    engine_args = {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "data_parallel_size": args.data_parallel_size,
    }
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_memory_bytes:
        engine_args["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    engine_args["kv_cache_dtype"] = args.kv_cache_dtype
    with LLM(args.model, **engine_args) as llm:
        tokenizer = llm.get_tokenizer()
        requests = build_workload(tokenizer, args.num_prompts, args.input_len, args.output_len, args.seed)
        warmup = build_workload(tokenizer, 4, args.input_len, LengthRange(4, 4), args.seed + 10_000)
        llm.generate([r.prompt_ids for r in warmup], [sampling_params(r) for r in warmup], use_tqdm=False)
        engine = run_tokenmill(llm, requests)
        if args.data_parallel_size > 1:  # the probe times one engine's decode steps: not a data-parallel figure
            return report_data_parallel(args, engine, llm.engine_info, folder)
        probe_input = args.probe_input_len or round(args.input_len.mean)
        probe, probe_output = run_decode_probe(
            llm, tokenizer, args.max_num_seqs, probe_input, args.probe_output_len, args.seed + 20_000
        )
        config, info = llm.config, llm.engine_info

    hf_config = load_hf_config(config.model)
    dtype_bytes = getattr(torch, info.dtype).itemsize
    cost = ModelCost.from_hf_config(hf_config, info.weight_bytes, dtype_bytes)
    # in the probe's window, sequences hold from probe_input + 1 to probe_input + probe_output tokens
    bound = decode_bound(cost, machine, probe.batch_size, probe_input + (probe_output + 1) / 2)

    baseline = None
    if not args.skip_baseline:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        baseline = run_baseline(config, info.dtype, requests, args.max_num_seqs, pad_id)

    table, data = report(args, machine, engine, probe, bound, baseline, info)
    print(table)
    for name, target in data["targets"].items():
        print(
            f"target {name}: {target['value']:.3g} (target {target['target']}) -> "
            f"{'met' if target['met'] else 'MISSED'}"
        )
    data["config"] = args_as_json(args)
    data["model_cost"] = asdict(cost)
    data["engine_info"] = {f: getattr(info, f) for f in info.__struct_fields__}
    achieved = probe.batch_size / probe.wall_step_time_s
    plot_roofline(machine, [(f"tokenmill decode, batch {probe.batch_size}", bound, achieved)], folder / "roofline.png")
    save_json(folder, data)
    print(f"results in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
