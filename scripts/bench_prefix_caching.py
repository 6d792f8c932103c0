"""Time to first token with prefix caching on vs off: N requests sharing a long prefix, each with a short own suffix.

For each mode a fresh `tokenmill serve` starts (same flags apart from `--[no-]enable-prefix-caching`), answers one
unrelated short request (so one-off start-up costs land in neither mode's numbers), then, by default, the shared
prefix alone (`--warmup prefix`: the usual setup; the cache holds the prefix when the burst arrives, as it would for
a system prompt that earlier traffic already used), then the N requests all at once. The warm-up is sent in both
modes so they do the same work before the burst. `--warmup none` sends the burst cold, as vLLM's serving benchmark
does: then the requests admitted in the first step all compute the prefix and only later ones hit.

TTFT is measured by the client from the streamed responses (first chunk carrying a token).

    python scripts/bench_prefix_caching.py [--num-requests 32] [--prefix-len 1000] [--suffix-len 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
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
from tqdm import tqdm

MODE_FLAGS = {"on": ["--enable-prefix-caching"], "off": ["--no-enable-prefix-caching"]}
REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1000, help="tokens every request shares")
    parser.add_argument("--suffix-len", type=int, default=16, help="distinct tokens after the prefix, per request")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens each request generates")
    parser.add_argument(
        "--warmup",
        choices=["prefix", "none"],
        default="prefix",
        help="send the shared prefix alone before the burst (default), or send the burst cold",
    )
    parser.add_argument("--modes", default="on,off", help="which of on,off to run, in this order")
    parser.add_argument(
        "--serve-args",
        default="--kv-cache-memory-bytes 1GiB",
        help="extra `tokenmill serve` flags for both servers (model, dtype, budgets, ...)",
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


async def run_burst(
    url: str, args: argparse.Namespace, prefix: list[int], suffixes: list[list[int]], progress: tqdm
) -> list[StreamTiming]:
    """Warm the server up, then send every request at once; returns their timings in request order."""
    async with http_session() as session:
        model = await served_model_name(session, url)
        await stream_completion(session, url, completion_payload(model, suffixes[0][::-1], 2), "model warm-up")
        if args.warmup == "prefix":
            warm = await stream_completion(session, url, completion_payload(model, prefix, 1), "prefix warm-up")
            if warm.error:
                raise RuntimeError(f"prefix warm-up failed: {warm.error}")

        async def one(i: int) -> StreamTiming:
            payload = completion_payload(model, prefix + suffixes[i], args.max_tokens)
            timing = await stream_completion(session, url, payload, f"request {i}")
            progress.update(1)
            return timing

        return await asyncio.gather(*(one(i) for i in range(len(suffixes))))


def measure_mode(
    mode: str, args: argparse.Namespace, prefix: list[int], suffixes: list[list[int]], results_dir: Path
) -> dict:
    serve_args = [*shlex.split(args.serve_args), *MODE_FLAGS[mode]]
    print(f"[{mode}] tokenmill serve {shlex.join(serve_args)}", file=sys.stderr)
    with launched_server(serve_args, results_dir / f"server-{mode}.log") as url:
        with tqdm(total=len(suffixes), desc=f"prefix caching {mode}", unit="req") as progress:
            timings = asyncio.run(run_burst(url, args, prefix, suffixes, progress))
    errors = [f"{t.label}: {t.error}" for t in timings if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    first_sent = min(t.sent_at for t in timings)
    return {
        "serve_args": serve_args,
        "ttft_ms": summarize([t.ttft for t in timings], scale=1000.0),
        "last_first_token_after_s": max(t.chunk_times[0] for t in timings) - first_sent,
        "mean_cached_tokens": float(np.mean([t.num_cached_tokens or 0 for t in timings])),
        "ttft_s_per_request": [t.ttft for t in timings],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.server_threads)  # inherited by the server processes
    rng = np.random.default_rng(args.seed)
    prefix = random_token_ids(rng, args.prefix_len)
    suffixes = [random_token_ids(rng, args.suffix_len) for _ in range(args.num_requests)]
    results_dir = make_results_dir(args.results_root, "prefix-caching")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    per_mode = {mode: measure_mode(mode, args, prefix, suffixes, results_dir) for mode in modes}

    results: dict = {"benchmark": "prefix-caching", "params": args_as_json(args), "modes": per_mode}
    if "on" in per_mode and "off" in per_mode:
        on, off = per_mode["on"]["ttft_ms"], per_mode["off"]["ttft_ms"]
        results["speedup_mean_ttft"] = off["mean"] / on["mean"]
        results["speedup_median_ttft"] = off["median"] / on["median"]
    path = save_json(results_dir, results)

    print(
        f"\n{args.num_requests} requests at once, {args.prefix_len}-token shared prefix + {args.suffix_len}-token "
        f"suffix each, warm-up: {args.warmup}"
    )
    print(
        f"{'caching':<8} {'mean TTFT':>10} {'median':>9} {'p90':>9} {'p99':>9} {'last 1st tok':>13} {'cached/req':>11}"
    )
    for mode, r in per_mode.items():
        t = r["ttft_ms"]
        print(
            f"{mode:<8} {t['mean']:>8.0f}ms {t['median']:>7.0f}ms {t['p90']:>7.0f}ms {t['p99']:>7.0f}ms "
            f"{r['last_first_token_after_s']:>12.2f}s {r['mean_cached_tokens']:>11.0f}"
        )
    if "speedup_mean_ttft" in results:
        print(
            f"prefix caching speed-up: {results['speedup_mean_ttft']:.1f}x mean TTFT, "
            f"{results['speedup_median_ttft']:.1f}x median TTFT"
        )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
