"""The CPU decode-attention kernel against the same kernel built from another revision, one sequence at a time.

SmolLM2-135M's shapes by default (9 query heads, 3 kv heads, head dim 64, 30 layers' float32 caches, blocks of 16
in consecutive places as the engine allocates them); each layer's cache is read once per "token", and 96 MB (the
default model's weights) are streamed between tokens, so the caches come from memory as in a batch-1 decode step.
Each build runs in its own process (the kernels are one compiled library per process), the two alternating round by
round so that both see the same machine; the figure is the median per-layer call time in microseconds, Python's
call overhead included (`--context-len 1` shows it).

    OMP_NUM_THREADS=2 python scripts/bench_decode_attention_cpu.py --baseline HEAD~1 --context-len 280
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def per_layer_us(source: Path, context_len: int, layers: int, tokens: int) -> float:
    """Median microseconds per layer's call over `tokens` passes of `layers` caches (the kernels built from
    `source`)."""
    import torch

    from tokenmill.kernels import cpu_ops

    cpu_ops.SOURCE = source  # before the library is first built and loaded in this process
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    blocks = -(-context_len // block_size)
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    caches = [torch.randn(2, blocks, block_size, kv_heads, head_dim) for _ in range(layers)]
    query, seq_lens = torch.randn(1, heads, head_dim), torch.tensor([context_len], dtype=torch.int32)
    out, starts = torch.empty_like(query), torch.tensor([0, 1], dtype=torch.int32)
    weights, times = torch.ones(24 << 20), []
    for _ in range(tokens):
        weights.sum()  # evicts the caches from the last-level cache, as a step's weight reads do
        started = time.perf_counter()
        for cache in caches:
            cpu_ops.decode_attention(out, query, cache[0], cache[1], table, starts, seq_lens, head_dim**-0.5)
        times.append((time.perf_counter() - started) / layers)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD~1", help="the git revision whose kernels/cpu_ops.cpp to compare")
    parser.add_argument("--context-len", type=int, default=280)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child-source", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_source:
        print(per_layer_us(Path(args.child_source), args.context_len, args.layers, args.tokens))
        return
    with tempfile.TemporaryDirectory() as folder:
        baseline = Path(folder) / "cpu_ops.cpp"
        baseline.write_bytes(
            subprocess.run(
                ["git", "show", f"{args.baseline}:kernels/cpu_ops.cpp"], cwd=REPO, check=True, capture_output=True
            ).stdout
        )
        sources = {args.baseline: baseline, "this checkout": REPO / "kernels" / "cpu_ops.cpp"}
        results: dict[str, list[float]] = {name: [] for name in sources}
        for _ in range(args.rounds):
            for name, source in sources.items():
                command = [sys.executable, __file__, "--child-source", str(source)]
                command += ["--context-len", str(args.context_len), "--layers", str(args.layers)]
                command += ["--tokens", str(args.tokens)]
                output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                results[name].append(float(output.split()[-1]))
    print(f"context {args.context_len}, {args.layers} layers: us per layer's call, each round")
    for name, values in results.items():
        print(f"  {name:>14}: " + ", ".join(f"{value:.1f}" for value in values))
    ratios = [new / old for old, new in zip(*results.values(), strict=True)]
    print("  ratio (this checkout / baseline): " + ", ".join(f"{ratio:.2f}" for ratio in ratios))


if __name__ == "__main__":
    main()
