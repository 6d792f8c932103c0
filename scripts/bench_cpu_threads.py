"""How many compute threads, and which OpenMP wait policy, a CPU worker should run with: decode steps at batch 1 and
at batch 8 (wall time, recorded steps as the engine runs them), each setting in its own process, the settings
alternating round by round so that all of them see the same machine.

A setting is a thread count and the OpenMP environment the worker process starts with: libgomp's default (threads
spin about 300,000 iterations at a barrier before sleeping, which on a 2-vCPU machine takes the core the scheduler and
the frontend need between steps), `OMP_WAIT_POLICY=PASSIVE` (sleep at once: every parallel region then pays a
futex wake-up, a few hundred per step at batch 1) or a short spin (`GOMP_SPINCOUNT`): long enough to cover the ~1 µs
gaps between replayed kernel calls, short enough that the threads sleep while the scheduler and the frontend work.

    python scripts/bench_cpu_threads.py --rounds 3

Meaningful only on an otherwise idle machine: on a loaded one every parallel region waits for a descheduled thread.
The `--child` mode is what each process runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SETTINGS: dict[str, dict[str, str]] = {
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "2 threads, libgomp default spin": {"OMP_NUM_THREADS": "2"},
    "2 threads, OMP_WAIT_POLICY=PASSIVE": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "2 threads, GOMP_SPINCOUNT=10000": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"},
    "2 threads, GOMP_SPINCOUNT=1000": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "1000"},
    "2 threads, GOMP_SPINCOUNT=100000": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "100000"},
}
BATCH_SIZES = (1, 8)


def child(context_len: int, steps: int) -> None:
    """Print {batch size: median decode step ms} for this process's OpenMP settings."""
    import torch
    from profile_decode import DecodeDriver, build_runner

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    figures = {}
    for batch in BATCH_SIZES:
        blocks_each = -(-(context_len + 2 * steps + 2) // 16)
        runner, _ = build_runner("", "auto", 1 + batch * blocks_each, 16)
        runner.capture_cuda_graphs()
        rng = np.random.default_rng(batch)
        prompts = [[int(t) for t in rng.integers(100, 20_000, context_len)] for _ in range(batch)]
        driver = DecodeDriver(runner, prompts, 2 * steps, 16)
        for _ in range(steps // 4):  # warm-up
            driver.step()
        figures[batch] = statistics.median(driver.step() for _ in range(steps)) * 1e3
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--context-len", type=int, default=200)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), help="which settings to run (default: all)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.context_len, args.steps)
        return
    print(f"load average before: {os.getloadavg()}, {os.cpu_count()} CPUs")
    chosen = {name: SETTINGS[name] for name in args.settings}
    if "1 thread" not in chosen:
        raise SystemExit('--settings must include "1 thread" (the baseline)')
    results: dict[str, dict[int, list[float]]] = {name: {b: [] for b in BATCH_SIZES} for name in chosen}
    command = [sys.executable, str(Path(__file__)), "--child", f"--steps={args.steps}"]
    command.append(f"--context-len={args.context_len}")
    for _ in range(args.rounds):
        for name, settings in chosen.items():
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))} | settings
            started = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            for batch in BATCH_SIZES:
                results[name][batch].append(figures[str(batch)])
            print(f"  {name}: {figures} ({time.perf_counter() - started:.0f} s)", flush=True)
    base = {batch: min(results["1 thread"][batch]) for batch in BATCH_SIZES}
    print("| setting | " + " | ".join(f"batch {b}: best step ms (vs 1 thread)" for b in BATCH_SIZES) + " |")
    print("| --- |" + " ---: |" * len(BATCH_SIZES))
    for name, by_batch in results.items():
        cells = [f"{min(by_batch[b]):.2f} ({min(by_batch[b]) / base[b]:.2f}x)" for b in BATCH_SIZES]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
