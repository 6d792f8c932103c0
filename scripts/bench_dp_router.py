"""The data-parallel router: prefix-cache hit rate and throughput of `--data-parallel-routing cache-aware` against
`round-robin`, on two replicas, in one run.

Workload: --num-system-prompts long "system prompts" (random token ids), --requests-per-prompt requests each (the
prompt then a short question of its own; short generations), in one seeded random order, sent by --concurrency
clients that each take the next request when their last one finishes. Each policy gets a fresh server with the same
flags; one unrelated request per replica warms it up first. The hit rate is the replicas' own count of prompt
tokens found in their prefix caches over those looked up (`vllm:prefix_cache_hits_total` /
`vllm:prefix_cache_queries_total`, summed over the `engine` label, measured around the workload).

Cache-aware routing matters when the replicas' caches together, not each alone, hold the working set of prefixes:
round-robin then sends every prefix to every replica, and each replica's LRU cache thrashes between them. The
default `--serve-args` give each replica 80 blocks of 16 tokens: two of the four 512-token system prompts (32 blocks
each) besides the running requests. `--serve-args` with a larger cache shows the cases between (with room for all
four, both policies miss only each prefix's first requests per replica).

    python scripts/bench_dp_router.py [--num-system-prompts 4] [--requests-per-prompt 64] [--system-len 512]
"""

from __future__ import annotations

import argparse
import asyncio
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
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_HIT_RATE_RATIO = 1.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-system-prompts", type=int, default=4)
    parser.add_argument("--requests-per-prompt", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=512, help="tokens of each system prompt")
    parser.add_argument("--question-len", type=int, default=24, help="tokens of each request's own part")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens each request generates")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--policies", default="cache-aware,round-robin")
    parser.add_argument(
        "--serve-args",
        default="--max-model-len 1024 --num-gpu-blocks-override 80",
        help="extra `tokenmill serve` flags for every server (model, dtype, cache size, ...)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-root", type=Path, default=REPO_ROOT / "bench_results")
    return parser.parse_args(argv)


async def scrape(session, url: str) -> dict[tuple[str, str], float]:
    """(sample name, engine label) -> value, for the per-replica scheduler counters."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "engine" in sample.labels:
                key = (sample.name, sample.labels["engine"] + sample.labels.get("reason", ""))
                samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def delta(after: dict, before: dict, name: str) -> dict[str, float]:
    return {
        engine: value - before.get((sample, engine), 0.0) for (sample, engine), value in after.items() if sample == name
    }


async def run_workload(
    url: str, args: argparse.Namespace, prompts: list[list[int]], warmups: list[list[int]], progress: tqdm
) -> tuple[list[StreamTiming], float, dict, dict]:
    async with http_session() as session:
        model = await served_model_name(session, url)
        warm = await asyncio.gather(
            *(stream_completion(session, url, completion_payload(model, ids, 2), "warm-up") for ids in warmups)
        )  # at once: one per replica, whatever the policy
        if any(t.error for t in warm):
            raise RuntimeError(f"warm-up failed: {[t.error for t in warm if t.error]}")
        await asyncio.sleep(1.0)  # the schedulers report their counters at least every half second
        before = await scrape(session, url)
        queue = list(enumerate(prompts))
        timings: list[StreamTiming | None] = [None] * len(prompts)

        async def client() -> None:
            while queue:
                index, ids = queue.pop(0)
                timings[index] = await stream_completion(
                    session, url, completion_payload(model, ids, args.max_tokens), f"request {index}"
                )
                progress.update(1)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        await asyncio.sleep(1.0)
        after = await scrape(session, url)
    return timings, elapsed, before, after


def measure_policy(
    policy: str, args: argparse.Namespace, prompts: list[list[int]], warmups: list[list[int]], results_dir: Path
) -> dict:
    serve_args = [
        *shlex.split(args.serve_args),
        "--data-parallel-size",
        str(args.data_parallel_size),
        "--data-parallel-routing",
        policy,
    ]
    print(f"[{policy}] tokenmill serve {shlex.join(serve_args)}", file=sys.stderr)
    with launched_server(serve_args, results_dir / f"server-{policy}.log") as url:
        with tqdm(total=len(prompts), desc=policy, unit="req") as progress:
            timings, elapsed, before, after = asyncio.run(run_workload(url, args, prompts, warmups, progress))
    errors = [f"{t.label}: {t.error}" for t in timings if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    queries = delta(after, before, "vllm:prefix_cache_queries_total")
    hits = delta(after, before, "vllm:prefix_cache_hits_total")
    routed = {
        key: value
        for key, value in delta(after, before, "tokenmill:data_parallel_routed_requests_total").items()
        if value
    }
    total_queries, total_hits = sum(queries.values()), sum(hits.values())
    prompt_tokens = sum(len(ids) for ids in prompts)
    return {
        "serve_args": serve_args,
        "elapsed_s": elapsed,
        "request_throughput": len(prompts) / elapsed,
        "prompt_token_throughput": prompt_tokens / elapsed,
        "hit_rate": total_hits / total_queries if total_queries else 0.0,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "per_replica_hit_rate": {e: hits.get(e, 0.0) / q for e, q in queries.items() if q},
        "routed_requests": routed,  # "<engine><reason>" -> requests
        "mean_cached_tokens": float(np.mean([t.num_cached_tokens or 0 for t in timings])),
        "ttft_ms": summarize([t.ttft for t in timings], scale=1000.0),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    systems = [random_token_ids(rng, args.system_len) for _ in range(args.num_system_prompts)]
    prompts = [
        systems[s] + random_token_ids(rng, args.question_len)
        for s in range(args.num_system_prompts)
        for _ in range(args.requests_per_prompt)
    ]
    prompts = [prompts[i] for i in rng.permutation(len(prompts))]
    warmups = [random_token_ids(rng, 8) for _ in range(args.data_parallel_size)]
    results_dir = make_results_dir(args.results_root, "dp-router")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    per_policy = {policy: measure_policy(policy, args, prompts, warmups, results_dir) for policy in policies}

    results: dict = {"benchmark": "dp-router", "params": args_as_json(args), "policies": per_policy}
    if "cache-aware" in per_policy and "round-robin" in per_policy:
        aware, rr = per_policy["cache-aware"], per_policy["round-robin"]
        ratio = aware["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
        results["hit_rate_ratio"] = ratio
        results["throughput_ratio"] = aware["request_throughput"] / rr["request_throughput"]
        results["targets"] = {
            "hit_rate_ratio": {"value": ratio, "target": TARGET_HIT_RATE_RATIO, "met": ratio >= TARGET_HIT_RATE_RATIO}
        }
    path = save_json(results_dir, results)

    print(
        f"\n{args.num_system_prompts} system prompts x {args.requests_per_prompt} requests ({args.system_len} + "
        f"{args.question_len} prompt tokens, {args.max_tokens} generated), {args.concurrency} in flight, "
        f"{args.data_parallel_size} replicas"
    )
    print(f"{'routing':<12} {'hit rate':>9} {'per replica':>20} {'req/s':>7} {'prompt tok/s':>13} {'mean TTFT':>10}")
    for policy, r in per_policy.items():
        per_replica = " ".join(f"{rate:.0%}" for _, rate in sorted(r["per_replica_hit_rate"].items()))
        print(
            f"{policy:<12} {r['hit_rate']:>9.1%} {per_replica:>20} {r['request_throughput']:>7.2f} "
            f"{r['prompt_token_throughput']:>13.0f} {r['ttft_ms']['mean']:>8.0f}ms"
        )
    if "hit_rate_ratio" in results:
        print(
            f"cache-aware / round-robin: hit rate {results['hit_rate_ratio']:.2f}x (target "
            f">= {TARGET_HIT_RATE_RATIO}x), throughput {results['throughput_ratio']:.2f}x"
        )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
