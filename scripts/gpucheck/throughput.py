"""(e) Offline throughput, tokenmill vs transformers, and where a decode step's time goes.

Per model (SmolLM2-135M's and Qwen2.5-0.5B's configs, random bf16 weights): 256 requests of 128 prompt and 128
output tokens (ignore_eos) through one `LLM.generate`, then the same requests through transformers `generate` in
static batches of 256 (same weights and dtype; `scripts/benchlib/hf_baseline.py`). The engine's own step timings
give the scheduling time per step outside the worker's forward. Then a `Worker` (`workers/worker.py`), in this
process, with its decode CUDA graphs captured, runs decode steps at batch 256 under torch.profiler
(`scripts/profile_decode.py`'s driver): per step, the host wall time, the time kernels kept the GPU busy (the union of
kernel intervals) and so the GPU idle share.
"""

from __future__ import annotations

import gc
import time

from benchlib.hf_baseline import load_hf_model, run_static_batches
from benchlib.workload import BenchRequest

from gpucheck.common import CheckContext, SectionResult, synchronize
from gpucheck.models import build_checkpoint

PROFILED_STEPS = 10


def requests_for(ctx: CheckContext, vocab_size: int) -> list[BenchRequest]:
    import numpy as np

    rng = np.random.default_rng(0)
    num, input_len, output_len = ctx.pick((256, 128, 128), (8, 16, 8))
    return [BenchRequest(rng.integers(3, vocab_size, input_len).tolist(), output_len) for _ in range(num)]


def tokenmill_run(ctx: CheckContext, path: str, requests: list[BenchRequest]) -> dict:
    from tokenmill import LLM, SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in requests]
    with LLM(
        path, dtype="bfloat16", **ctx.engine_args(), max_num_seqs=len(requests), gpu_memory_utilization=0.8
    ) as llm:
        llm.generate([r.prompt_ids for r in requests[:8]], params[:8], use_tqdm=False)  # warm-up
        before = llm.engine_stats()
        started = time.perf_counter()
        results = llm.generate([r.prompt_ids for r in requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        stats = llm.engine_stats().since(before)
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    steps = max(stats.num_steps, 1)
    return {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "steps": stats.num_steps,
        "step_ms": 1e3 * stats.step_time_s / steps,
        "scheduling_ms_per_step": 1e3 * (stats.step_time_s - stats.model_time_s) / steps,
    }


def transformers_run(ctx: CheckContext, path: str, requests: list[BenchRequest], pad_id: int) -> dict:
    import torch

    model = load_hf_model(path, None, torch.bfloat16).to(ctx.device)
    run = run_static_batches(model, requests, batch_size=len(requests), pad_id=pad_id)
    del model
    gc.collect()
    return {
        "elapsed_s": run.elapsed_s,
        "output_tokens": run.useful_output_tokens,
        "output_tokens_per_s": run.output_throughput,
    }


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def top_events(averages, key: str, count: int = 12) -> list[dict]:
    """The profiler's `count` largest events by `key` (self device or self CPU time): name, calls, microseconds per
    profiled step, where the next round of work on the step should look."""
    ranked = sorted(averages, key=lambda event: getattr(event, key, 0.0), reverse=True)[:count]
    return [
        {"name": event.key[:120], "calls": event.count, "us_per_step": getattr(event, key, 0.0) / PROFILED_STEPS}
        for event in ranked
        if getattr(event, key, 0.0) > 0
    ]


def profiled_decode_steps(ctx: CheckContext, path: str, batch: int, context: int) -> dict:
    """Decode steps of a `Worker` at `batch` under torch.profiler: host ms per step, GPU busy and idle."""
    import torch
    from profile_decode import DecodeDriver, build_runner

    block_size = 16
    blocks_each = -(-(context + PROFILED_STEPS + 8) // block_size)
    runner, _ = build_runner(path, "bfloat16", batch * blocks_each + 1, block_size)
    if ctx.device == "cuda":
        runner.capture_cuda_graphs()
    driver = DecodeDriver(
        runner, [[3 + (i + j) % 400 for j in range(context)] for i in range(batch)], PROFILED_STEPS + 4, block_size
    )
    for _ in range(3):
        driver.step()
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if ctx.device == "cuda" else []
    )
    synchronize(ctx.device)
    with torch.profiler.profile(activities=activities) as profile:
        host_s = [driver.step() for _ in range(PROFILED_STEPS)]
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in profile.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    window_us = 1e6 * sum(host_s)
    busy = busy_us(kernels)
    averages = profile.key_averages()
    return {
        "top_kernels": top_events(averages, "self_device_time_total"),
        "top_host_ops": top_events(averages, "self_cpu_time_total"),
        "batch": batch,
        "context": context,
        "steps": PROFILED_STEPS,
        "host_ms_per_step": 1e3 * sum(host_s) / len(host_s),
        "gpu_busy_ms_per_step": busy / 1e3 / PROFILED_STEPS,
        "num_kernels": len(kernels),
        "gpu_idle_fraction": (1 - busy / window_us) if kernels else None,
    }


def profile_line(profile: dict) -> str:
    line = (
        f"decode steps at batch {profile['batch']} (context {profile['context']}, the worker's runner in-process): "
        f"{profile['host_ms_per_step']:.2f} ms host per step"
    )
    idle = profile["gpu_idle_fraction"]
    if idle is None:
        return line + ", GPU idle not measured (no CUDA)"
    return line + f", {profile['gpu_busy_ms_per_step']:.2f} ms GPU busy, GPU idle {idle:.1%} of the step"


def run(ctx: CheckContext) -> SectionResult:
    """The decode profile first (the first device run ran out of time before it), then each model's throughput."""
    from transformers import AutoConfig

    path = str(build_checkpoint("smollm2-135m", ctx.work_dir / "checkpoints", "bfloat16", ctx.dry_run))
    profile = profiled_decode_steps(ctx, path, *ctx.pick((256, 256), (4, 16)))
    print(f"[throughput] {profile_line(profile)}", flush=True)
    rows: list[dict] = []
    ctx.save_partial({"throughput": rows, "decode_profile": profile})
    summary = [
        "| model | tokenmill tok/s | transformers tok/s | ratio | steps | ms/step | scheduling ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ctx.pick(("smollm2-135m", "qwen2.5-0.5b"), ("smollm2-135m",)):
        path = str(build_checkpoint(name, ctx.work_dir / "checkpoints", "bfloat16", ctx.dry_run))
        config = AutoConfig.from_pretrained(path)
        requests = requests_for(ctx, config.vocab_size)
        ours = tokenmill_run(ctx, path, requests)
        theirs = transformers_run(ctx, path, requests, pad_id=config.eos_token_id)
        ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        rows.append({"model": name, "tokenmill": ours, "transformers": theirs, "ratio": ratio})
        ctx.save_partial({"throughput": rows, "decode_profile": profile})
        summary.append(
            f"| {name} | {ours['output_tokens_per_s']:.0f} | {theirs['output_tokens_per_s']:.0f} | "
            f"{ratio:.1f}x | {ours['steps']} | {ours['step_ms']:.2f} | "
            f"{ours['scheduling_ms_per_step']:.2f} |"
        )
        print(f"[throughput] {summary[-1]}", flush=True)
    summary += ["", profile_line(profile)]
    for title, key in (("GPU kernels", "top_kernels"), ("host operators", "top_host_ops")):
        summary += ["", f"top {title} (self time, us per step):"]
        summary += [
            f"- {event['us_per_step']:.0f} us, {event['calls']} calls: {event['name']}" for event in profile[key][:8]
        ]
    passed = all(row["tokenmill"]["output_tokens"] == row["transformers"]["output_tokens"] for row in rows)
    return SectionResult(passed, {"throughput": rows, "decode_profile": profile}, summary)
