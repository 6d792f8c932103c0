"""Where a long prompt's prefill goes: one request of --prompt-len tokens through the `Worker`, in this process.

Prints the prefill's CPU time (this thread's, so other processes on a shared machine do not inflate it; run with
OMP_NUM_THREADS=1 for it to be the whole cost), the profiler's top operators (the compiled CPU kernels as
`cpu_ops::*`, SDPA as aten's flash-attention op), and every GGUF matmul shape by type: calls, CPU time, GOPS.

    OMP_NUM_THREADS=1 python scripts/profile_prefill.py \
        --model ~/.cache/tokenmill/llama.cpp/models/qwen2.5-0.5b-random-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch
from profile_decode import build_runner, label_cpu_kernels

from tokenmill.messages import NewRequestData, SamplingParams, StepPlan
from tokenmill.workers.worker import Worker


def prefill_seconds(runner: Worker, prompt: list[int], step: int, block_size: int) -> float:
    """One fresh request's prefill step (KV blocks alternate between two ranges); its thread CPU time."""
    blocks = -(-(len(prompt) + 2) // block_size)
    first = 1 + (step % 2) * blocks
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    block_ids = list(range(first, first + blocks))
    request = NewRequestData(f"p{step}", prompt, len(prompt), greedy, block_ids, 0, len(prompt))
    started = time.thread_time()
    runner.execute(StepPlan(step, [request], [], []))
    return time.thread_time() - started


def time_gguf_matmuls() -> dict[tuple, list[float]]:
    """Wrap GGUFWeight.matmul to sum each (type, out, in, tokens) shape's calls and CPU time."""
    import gguf

    from tokenmill.workers.quantization.gguf import GGUFWeight

    stats: dict[tuple, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    matmul = GGUFWeight.matmul

    def timed(self: GGUFWeight, x: torch.Tensor) -> torch.Tensor:
        started = time.thread_time()
        out = matmul(self, x)
        tokens = x.numel() // x.shape[-1]
        shape = (gguf.GGMLQuantizationType(self.qtype).name, self.out_features, self.in_features, tokens)
        stats[shape][0] += 1
        stats[shape][1] += time.thread_time() - started
        return out

    GGUFWeight.matmul = timed  # type: ignore[method-assign]
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    block_size = 16
    runner, _ = build_runner(args.model, "auto", 2 * (-(-(args.prompt_len + 2) // block_size)) + 1, block_size)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20_000, args.prompt_len)]
    seconds = [prefill_seconds(runner, prompt, step, block_size) for step in range(args.repeats)]
    cpu_ms = [round(s * 1e3) for s in seconds]
    print(f"{args.prompt_len}-token prefill, {torch.get_num_threads()} threads: CPU ms {cpu_ms}")
    label_cpu_kernels()
    stats = time_gguf_matmuls()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        prefill_seconds(runner, prompt, args.repeats, block_size)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    print("GGUF matmuls (type, out, in, tokens): calls, CPU ms, GOPS")
    for (name, rows, cols, tokens), (calls, total) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        gops = 2 * rows * cols * tokens * calls / total / 1e9
        print(f"  {name} {rows}x{cols} T={tokens}: {calls} calls, {total * 1e3:.1f} ms, {gops:.0f} GOPS")


if __name__ == "__main__":
    main()
