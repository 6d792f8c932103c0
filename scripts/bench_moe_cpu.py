"""Time the two CPU grouped paths of `workers/models/moe.py` on one MoE layer: a batch-32 decode and a 512-token
prefill. Path "loop": tokens sorted by expert, one torch.mm per active expert over its slice; path "grouped_mm": the
same sorted rows through torch's `grouped_mm`, one call per projection.

    python scripts/bench_moe_cpu.py [--experts 64 --top-k 8 --hidden 2048 --inter 1024 --threads N]

The default layer is OLMoE-1B-7B's (64 experts, top-8, hidden 2048, expert intermediate 1024), float32.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.workers.models.moe import grouped_experts, route


def time_paths(x, w13, w2, ids, weights, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` milliseconds per path, the paths interleaved so a busy machine slows both alike."""
    best = {"loop": float("inf"), "grouped_mm": float("inf")}
    for _ in range(repeats + 1):  # the first round warms up
        for name in best:
            start = time.perf_counter()
            grouped_experts(x, w13, w2, ids, weights, use_grouped_mm=name == "grouped_mm")
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, generator=g) / args.hidden**0.5
    w2 = torch.randn(args.experts, args.hidden, args.inter, generator=g) / args.inter**0.5
    router = torch.randn(args.experts, args.hidden, generator=g)
    print(
        f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, inter {args.inter}, "
        f"{torch.get_num_threads()} threads, float32"
    )
    with torch.inference_mode():
        for label, tokens in [("decode batch 32", 32), ("prefill 512 tokens", 512)]:
            x = torch.randn(tokens, args.hidden, generator=g)
            weights, ids = route(x @ router.t(), args.top_k, True, False)
            loop = grouped_experts(x, w13, w2, ids, weights, use_grouped_mm=False)
            fused = grouped_experts(x, w13, w2, ids, weights, use_grouped_mm=True)
            torch.testing.assert_close(loop, fused, atol=1e-4, rtol=1e-4)
            times = time_paths(x, w13, w2, ids, weights, args.repeats)
            print(f"{label}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in times.items()))


if __name__ == "__main__":
    main()
