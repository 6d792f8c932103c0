"""GGUF int8 matmul kernels of another git revision against the worktree's, in one process: the same weights and
activations through both libraries, timed alternately (best of `--reps` by this thread's CPU time, so preemption on a
shared machine does not count), one thread. Each library runs the layout it has for the type: repacked where
`gguf_ops.repack_wanted` says so and the old revision's kernels had the layout, else plain.

    python scripts/bench_gguf_ab.py --base HEAD~3 --tokens 1 16 --isa avx512 avx2 \
        --cases Q4_K:896x4864 Q6_K:896x4864

Prints per case both times, base / new (above 1: the worktree's is faster) and whether the outputs are the same bits.
At one token the weights cycle through a pool of copies (`--pool-mb`) so they come from memory, as in a decode step.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one compute thread, set before any OpenMP runtime starts

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_gguf_gemv import random_blocks
from gguf import GGMLQuantizationType

from tokenmill.kernels import cpu_ops, gguf_ops

REPO = Path(__file__).resolve().parent.parent


def load(source: Path) -> ctypes.CDLL:
    """The kernels built from `source` (cached by content, as the engine builds them)."""
    lib = ctypes.CDLL(str(cpu_ops.build(source=source, flags=gguf_ops.build_flags())))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.tm_gguf_matmul_cycle.argtypes = [i32, i32, ptr, ptr, i64, i64, i64, i64, i64, ptr]
    lib.tm_gguf_set_isa.argtypes = [i32]
    lib.tm_gguf_repack.argtypes = [i32, ptr, i64, i64, ptr]
    return lib


def source_at(revision: str, directory: Path) -> Path:
    """kernels/gguf_cpu.cpp at `revision`, written into `directory` (it includes itself by its own name)."""
    text = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:kernels/gguf_cpu.cpp"], check=True, capture_output=True
    ).stdout
    path = directory / "gguf_cpu.cpp"
    path.write_bytes(text)
    return path


def layout(lib: ctypes.CDLL, plain: torch.Tensor, qtype: int, n: int, k: int) -> tuple[torch.Tensor, bool]:
    """The blocks as this library runs them: repacked where wanted and it has the layout, else plain."""
    if not gguf_ops.repack_wanted(qtype, n):
        return plain, False
    packed = torch.empty_like(plain)
    if lib.tm_gguf_repack(qtype, plain.data_ptr(), n, k, packed.data_ptr()) != 0:
        return plain, False
    return packed, True


def compare(libs: dict[str, ctypes.CDLL], case: str, tokens: int, args: argparse.Namespace) -> str:
    type_name, shape = case.split(":")
    n, k = (int(v) for v in shape.split("x"))
    qtype = int(GGMLQuantizationType[type_name])
    rng = np.random.default_rng(0)
    plain = torch.from_numpy(random_blocks(type_name, n, k, rng))
    copies = max(2, -(-int(args.pool_mb * 2**20) // plain.numel())) if tokens == 1 else 2
    runs = {}
    for name, lib in libs.items():
        blocks, repacked = layout(lib, plain, qtype, n, k)
        pool = [blocks] + [blocks.clone() for _ in range(copies - 1)]
        runs[name] = (lib, repacked, pool, (ctypes.c_void_p * copies)(*[b.data_ptr() for b in pool]))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    calls = max(copies, int(args.min_gmac * 1e9 // (n * k * tokens)))
    best, outputs = {}, {}
    for rep in range(args.reps + 1):  # the first round warms up
        for name, (lib, repacked, _pool, pointers) in runs.items():
            y = np.empty((tokens, n), dtype=np.float32)
            start = time.thread_time()
            status = lib.tm_gguf_matmul_cycle(
                qtype, int(repacked), x.ctypes.data, pointers, copies, calls, tokens, n, k, y.ctypes.data
            )
            if status != 0:
                raise SystemExit(f"{name} refused {case}: {status}")
            if rep:
                best[name] = min(best.get(name, float("inf")), (time.thread_time() - start) / calls)
            outputs[name] = y
    layouts = "/".join("repacked" if runs[name][1] else "plain" for name in runs)
    return (
        f"{gguf_ops.isa():6} T={tokens:<3} {type_name:6} {n:>6}x{k:<5} {layouts:17} base {best['base'] * 1e6:9.1f} us  "
        f"new {best['new'] * 1e6:9.1f} us  base/new {best['base'] / best['new']:5.2f}  "
        f"same bits {np.array_equal(outputs['base'], outputs['new'])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernels are the baseline")
    parser.add_argument("--cases", nargs="+", required=True, help="TYPE:NxK, e.g. Q4_K:896x4864")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--isa", nargs="+", default=None, help="versions to run (default: avx512, avx2 available)")
    parser.add_argument("--reps", type=int, default=7, help="alternated timings, best kept")
    parser.add_argument("--pool-mb", type=float, default=64.0, help="weight copies cycled through at one token")
    parser.add_argument("--min-gmac", type=float, default=2.0, help="multiply-adds per timing, in billions")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        libs = {"base": load(source_at(args.base, Path(directory))), "new": load(REPO / "kernels" / "gguf_cpu.cpp")}
    available = gguf_ops.available_isas()
    for isa in args.isa or [name for name in ("avx512", "avx2") if name in available]:
        gguf_ops.set_isa(isa)
        for lib in libs.values():
            lib.tm_gguf_set_isa(gguf_ops.ISA_CODES[isa])
        for tokens in args.tokens:
            for case in args.cases:
                print(compare(libs, case, tokens, args), flush=True)


if __name__ == "__main__":
    main()
