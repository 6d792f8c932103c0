"""TTFT of high-priority requests under a saturating low-priority load: `--scheduling-policy priority` vs `fcfs`.

For each policy a fresh `tokenmill serve` starts with a small `--max-num-seqs`, so that a burst of --num-low
low-priority requests (priority --low-priority, default 0) leaves a queue of waiting requests. Once the first of them
has streamed a token, --num-high high-priority requests (priority --high-priority, default -1: lower values run first,
as in vLLM) arrive every --high-interval-s seconds. Reported: mean/p90 TTFT of the high-priority requests, how many
low-priority requests were still waiting (had no token yet) when each one was sent, and the low-priority TTFT and
total time, to show what the high-priority requests cost the rest.

Under fcfs a high-priority request waits behind every request queued before it; under priority it takes the next
free sequence slot. Running requests are not preempted for a free slot (as in vLLM), only when KV blocks run out.

    python scripts/bench_priority.py [--max-num-seqs 4] [--num-low 24] [--num-high 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
from benchlib.launch import launched_server
from benchlib.results import args_as_json, make_results_dir, save_json
from benchlib.stats import summarize
from benchlib.streaming import (
    StreamTiming,
    completion_payload,
    http_session,
    random_token_ids,
    served_model_name,
    stream_completion,
)
from benchlib.workload import LengthRange
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="priority,fcfs", help="which of priority,fcfs to run, in order")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="for both servers: what the load saturates")
    parser.add_argument("--num-low", type=int, default=24, help="low-priority requests, sent all at once")
    parser.add_argument("--low-prompt-len", type=LengthRange.parse, default=LengthRange(64, 64))
    parser.add_argument(
        "--low-output-len",
        type=LengthRange.parse,
        default=LengthRange(16, 48),
        help="tokens each low-priority request generates, e.g. 16:48",
    )
    parser.add_argument("--num-high", type=int, default=4)
    parser.add_argument("--high-prompt-len", type=int, default=64)
    parser.add_argument("--high-output-len", type=int, default=8)
    parser.add_argument(
        "--high-start-s",
        type=float,
        default=1.0,
        help="first high-priority request this long after the load's first token",
    )
    parser.add_argument("--high-interval-s", type=float, default=2.0)
    parser.add_argument("--low-priority", type=int, default=0)
    parser.add_argument("--high-priority", type=int, default=-1)
    parser.add_argument(
        "--serve-args", default="--kv-cache-memory-bytes 1GiB", help="extra `tokenmill serve` flags for both servers"
    )
    parser.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the servers (torch threads); 1 avoids oversubscribing a shared CPU",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-root", type=Path, default=REPO_ROOT / "bench_results")
    return parser.parse_args(argv)


def build_payloads(model: str, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng(args.seed)  # the same requests under every policy
    prompt_lens = args.low_prompt_len.sample(rng, args.num_low)
    output_lens = args.low_output_len.sample(rng, args.num_low)
    low = [
        completion_payload(model, random_token_ids(rng, n_in), n_out, priority=args.low_priority)
        for n_in, n_out in zip(prompt_lens, output_lens)
    ]
    high = [
        completion_payload(
            model, random_token_ids(rng, args.high_prompt_len), args.high_output_len, priority=args.high_priority
        )
        for _ in range(args.num_high)
    ]
    return low, high


async def run_load(
    url: str, args: argparse.Namespace, desc: str
) -> tuple[list[StreamTiming], list[StreamTiming], list[int]]:
    """Send the low-priority burst, then the high-priority requests on their schedule; wait for all of them.
    Also returns, for each high-priority request, how many low-priority ones had no token yet when it was sent."""
    async with http_session() as session:
        model = await served_model_name(session, url)
        warm_up_prompt = random_token_ids(np.random.default_rng(args.seed + 1), 16)
        await stream_completion(session, url, completion_payload(model, warm_up_prompt, 2), "warm-up")
        low_payloads, high_payloads = build_payloads(model, args)
        low = [StreamTiming(f"low {i}", 0.0) for i in range(len(low_payloads))]
        high = [StreamTiming(f"high {i}", 0.0) for i in range(len(high_payloads))]
        tasks = [asyncio.create_task(stream_completion(session, url, p, timing=t)) for p, t in zip(low_payloads, low)]
        progress = tqdm(total=len(low) + len(high), desc=desc, unit="req")
        for task in tasks:
            task.add_done_callback(lambda _: progress.update(1))
        while not any(t.chunk_times for t in low):
            await asyncio.sleep(0.01)
        first_token_at = time.perf_counter()
        low_waiting_at_send = []
        for i, (payload, timing) in enumerate(zip(high_payloads, high)):
            await asyncio.sleep(
                max(0.0, first_token_at + args.high_start_s + i * args.high_interval_s - time.perf_counter())
            )
            low_waiting_at_send.append(sum(1 for t in low if not t.chunk_times))
            task = asyncio.create_task(stream_completion(session, url, payload, timing=timing))
            task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)
        await asyncio.gather(*tasks)
        progress.close()
        return low, high, low_waiting_at_send


def measure_policy(policy: str, args: argparse.Namespace, results_dir: Path) -> dict:
    serve_args = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        *shlex.split(args.serve_args),
        "--scheduling-policy",
        policy,
    ]
    print(f"[{policy}] tokenmill serve {shlex.join(serve_args)}", file=sys.stderr)
    with launched_server(serve_args, results_dir / f"server-{policy}.log") as url:
        low, high, low_waiting_at_send = asyncio.run(run_load(url, args, policy))
    errors = [f"{t.label}: {t.error}" for t in [*low, *high] if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    first_sent = min(t.sent_at for t in low)
    return {
        "serve_args": serve_args,
        "high_ttft_ms": summarize([t.ttft for t in high], scale=1000.0),
        "low_ttft_ms": summarize([t.ttft for t in low], scale=1000.0),
        "low_waiting_when_high_sent": low_waiting_at_send,
        "all_done_after_s": max(t.chunk_times[-1] for t in [*low, *high]) - first_sent,
        "high_ttft_s_per_request": [t.ttft for t in high],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.server_threads)  # inherited by the server processes
    results_dir = make_results_dir(args.results_root, "priority")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    per_policy = {policy: measure_policy(policy, args, results_dir) for policy in policies}
    results: dict = {"benchmark": "priority", "params": args_as_json(args), "policies": per_policy}
    if "priority" in per_policy and "fcfs" in per_policy:
        results["high_mean_ttft_ratio_fcfs_over_priority"] = (
            per_policy["fcfs"]["high_ttft_ms"]["mean"] / per_policy["priority"]["high_ttft_ms"]["mean"]
        )
    path = save_json(results_dir, results)

    print(
        f"\n{args.num_low} low-priority requests at once (max {args.max_num_seqs} running), {args.num_high} "
        f"high-priority ones every {args.high_interval_s:g} s"
    )
    print(f"{'policy':<9} {'high TTFT mean':>15} {'p90':>9} {'low TTFT mean':>14} {'all done':>9}  low waiting at send")
    for policy, r in per_policy.items():
        h, lo = r["high_ttft_ms"], r["low_ttft_ms"]
        print(
            f"{policy:<9} {h['mean']:>13.0f}ms {h['p90']:>7.0f}ms {lo['mean']:>12.0f}ms "
            f"{r['all_done_after_s']:>8.1f}s  {r['low_waiting_when_high_sent']}"
        )
    if "high_mean_ttft_ratio_fcfs_over_priority" in results:
        print(
            f"high-priority mean TTFT: {results['high_mean_ttft_ratio_fcfs_over_priority']:.1f}x lower with "
            f"--scheduling-policy priority"
        )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
