"""What the dashboard's per-step summary costs the engine: its own step timing at batch 32, summaries on vs off.

The offline `LLM` runs the same batch (`--batch` prompts of `--prompt-len` distinct tokens, `--max-tokens` each,
greedy, EOS ignored) in `--rounds` rounds per mode, the modes alternating (off, on, on, off, ...) so drift in a shared
machine's speed falls on both. "on" is what a connected dashboard asks of the scheduler: `LLM.watch_steps` sends
`WatchSteps(--interval)`, so a `StepSummary` is built and sent at most every interval and the client decodes each.
"off" is an engine nobody watches (it still records every step's token counts in its ring).

Reported:
- the engine's mean step time per mode (the scheduler's own `step_time_s / num_steps`, which includes building and
  sending summaries; the median over the mode's rounds) and their ratio, on / off, with the median of the per-round
  on/off pairs: the issue's figure. On a shared CPU these carry the machine's noise (see the per-round figures in
  results.json); the direct figures below do not;
- the scheduler's CPU time spent on summaries (the summaries carry it) per step, as a fraction of the step time;
- in-process timings of the two pieces on the engine's real pool size with `--batch` running requests: `record`
  (every step, watched or not) and `build` + msgpack encode (per summary).

    python scripts/bench_dashboard.py [--batch 32] [--prompt-len 128] [--max-tokens 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec
from benchlib.results import args_as_json, make_results_dir, save_json

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model to load (default: the shipped SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32, help="requests run together (max_num_seqs)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="generate() calls per mode, the modes alternating")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between summaries when on (20/s)")
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=4 << 30,
        help="KV budget: the block map's size (4 GiB: ~5,800 blocks of SmolLM2)",
    )
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--results-root", type=Path, default=REPO_ROOT / "bench_results")
    return parser.parse_args(argv)


def prompts(args: argparse.Namespace, round_index: int) -> list[list[int]]:
    """Random token ids (SmolLM2's vocabulary holds 49,152), new for every prompt and round: no prefix-cache hits."""
    rng = random.Random(round_index)
    return [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)]


def run_rounds(llm, args: argparse.Namespace) -> dict:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # warm-up, measured in neither mode: kernels, weight packing, the batch's shapes
    llm.generate(prompts(args, 999), msgspec.structs.replace(params, max_tokens=8), use_tqdm=False)
    order = []  # off on, on off, off on, ...: each mode goes first as often
    for r in range(args.rounds):
        order += ["off", "on"] if r % 2 == 0 else ["on", "off"]
    rounds: dict[str, list[dict]] = {"off": [], "on": []}
    for index, mode in enumerate(order):
        summaries = []
        if mode == "on":
            llm.watch_steps(summaries.append, args.interval)
        before = llm.engine_stats()
        start = time.perf_counter()
        outputs = llm.generate(prompts(args, index), params, use_tqdm=False)
        wall = time.perf_counter() - start
        stats = llm.engine_stats().since(before)
        if mode == "on":
            llm.watch_steps(None)
        assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outputs)
        record = {
            "mode": mode,
            "steps": stats.num_steps,
            "step_time_s": stats.step_time_s,
            "mean_step_ms": 1000 * stats.step_time_s / stats.num_steps,
            "wall_s": wall,
            "summaries": len(summaries),
        }
        if summaries:
            # summary_time_s is the scheduler's running total before each summary was built: between the first and
            # the last it grew by the cost of the summaries before the last, which carried these steps
            record["summary_cpu_s"] = summaries[-1].summary_time_s - summaries[0].summary_time_s
            record["summary_steps"] = sum(len(s.steps) for s in summaries[:-1])
            record["summaries_per_s"] = len(summaries) / wall
            record["max_batch_seen"] = max(len(s.queue) for s in summaries)
            record["num_blocks"] = summaries[-1].num_blocks
        rounds[mode].append(record)
        print(
            f"round {index + 1}/{len(order)} {mode:>3}: {stats.num_steps} steps, mean step "
            f"{record['mean_step_ms']:.1f} ms, {len(summaries)} summaries",
            flush=True,
        )
    return rounds


def micro_timings(num_blocks: int, args: argparse.Namespace) -> dict:
    """record() and build() + encode in this process, on a scheduler holding `batch` running requests."""
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tokenmill.messages import StepResult, encode
    from tokenmill.scheduler.scheduler import Scheduler
    from tokenmill.scheduler.step_summary import StepSummarizer

    config = EngineConfig(
        model=ModelConfig(max_model_len=args.max_model_len),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=1 << 20),
    )
    sched = Scheduler(config, num_blocks, [])
    from tokenmill import SamplingParams
    from tokenmill.messages import EngineRequest

    for i, prompt in enumerate(prompts(args, 0)):
        sched.add_request(
            EngineRequest(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
            )
        )
    plan = None
    for _ in range(args.max_tokens // 2):  # prefill, then decode to mid-generation
        plan = sched.schedule()
        ids = [n.request_id for n in plan.new_requests] + [r.request_id for r in plan.running]
        sched.update(plan, StepResult(plan.step_id, ids, [7] * len(ids)))
    plan = sched.schedule()  # a pure decode step of the whole batch
    summarizer = StepSummarizer(lambda summary: encode(summary))
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        summarizer.record(plan, 0.1, 0)
    record_us = 1e6 * (time.perf_counter() - start) / n
    summarizer.watch(1e-9)
    n = 300
    start = time.perf_counter()
    for _ in range(n):
        summarizer.next_due = 0.0
        summarizer.maybe_publish(sched)
    build_us = 1e6 * (time.perf_counter() - start) / n
    summary = summarizer.build(sched)
    return {
        "record_us": record_us,
        "build_and_encode_us": build_us,
        "batch": len(plan.running),
        "in_use_blocks": summary.num_blocks - summary.num_free_blocks,
        "num_blocks": num_blocks,
        "encoded_bytes": len(encode(summary)),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tokenmill import LLM

    folder = make_results_dir(args.results_root, "dashboard")
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.batch,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    )
    try:
        rounds = run_rounds(llm, args)
        num_blocks = llm.engine_info.num_kv_blocks
    finally:
        llm.shutdown()
    micro = micro_timings(num_blocks, args)

    def mean_step_ms(mode: str) -> float:  # the median round's mean: one round slowed by the machine moves it least
        return statistics.median(r["mean_step_ms"] for r in rounds[mode])

    off_ms, on_ms = mean_step_ms("off"), mean_step_ms("on")
    summary_steps = sum(r.get("summary_steps", 0) for r in rounds["on"])
    summary_cpu_s = sum(r.get("summary_cpu_s", 0.0) for r in rounds["on"])
    summary_ms_per_step = 1000 * summary_cpu_s / max(summary_steps, 1)
    result = {
        "args": args_as_json(args),
        "rounds": rounds,
        "micro": micro,
        "mean_step_ms": {"off": off_ms, "on": on_ms},
        "ratio_on_off": on_ms / off_ms,
        # the fastest round of each mode is the one the machine disturbed least
        "ratio_fastest_rounds": min(r["mean_step_ms"] for r in rounds["on"])
        / min(r["mean_step_ms"] for r in rounds["off"]),
        "round_ratios_median": statistics.median(
            on["mean_step_ms"] / off["mean_step_ms"] for on, off in zip(rounds["on"], rounds["off"])
        ),
        "summary_cpu_ms_per_step": summary_ms_per_step,
        "summary_fraction_of_step": summary_ms_per_step / on_ms,
        "summaries_per_s": statistics.mean(r["summaries_per_s"] for r in rounds["on"]),
        "record_fraction_of_step": micro["record_us"] / 1000 / off_ms,
    }
    save_json(folder, result)
    print(f"\nbatch {args.batch}, {num_blocks} KV blocks, {args.rounds} rounds per mode ({folder})")
    print(
        f"engine step time (scheduler's own timing): off {off_ms:.1f} ms, on {on_ms:.1f} ms -> "
        f"on/off = {result['ratio_on_off']:.4f} (median of per-round pairs {result['round_ratios_median']:.4f}, "
        f"fastest rounds {result['ratio_fastest_rounds']:.4f})"
    )
    print(
        f"summaries: {result['summaries_per_s']:.1f}/s, scheduler CPU {summary_ms_per_step * 1000:.0f} us per step "
        f"= {100 * result['summary_fraction_of_step']:.3f} % of step time"
    )
    print(
        f"in-process: record {micro['record_us']:.1f} us per step (always on, "
        f"{100 * result['record_fraction_of_step']:.4f} % of a step), build + encode "
        f"{micro['build_and_encode_us']:.0f} us per summary ({micro['encoded_bytes']} bytes, "
        f"{micro['in_use_blocks']} blocks in use)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
