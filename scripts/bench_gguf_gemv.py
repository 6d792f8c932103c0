"""Batch-1 GGUF GEMV against the single-thread read bandwidth: each type's weight bytes per second over the bytes per
second one thread streams from memory, per shape and instruction set, in one run.

The bound is the fastest of several read loops over a 512 MiB buffer (16x the L3), in the same library and thread as
the kernels: `tm_gguf_read_sum` (kernels/gguf_cpu.cpp) with AVX-512, AVX2 or 64-bit loads, 1 to 8 independent
streams read side by side, with and without a software prefetch, and the old single-stream `tm_gguf_stream_sum`. The
old loop's 64-bit words read 24-33 GB/s where vector loads read 39-42 on a Zen 4 core (one stream of AVX-512 loads
~41, two side by side ~42), so the old bound made the kernels look closer to it than they are. The loops are timed
once first (printed), then the fastest one is the bound, timed alternately with each GEMV. Each GEMV is
`tm_gguf_matmul_cycle`: back-to-back int8 matmuls of one activation row over a pool of copies of the weight at least
`--pool-mb` large, so every call reads its weights from memory and no Python runs between calls. Each type runs in
the layout the engine gives it (repacked where `gguf_ops.repack_wanted` says so). The k-quants need rows that are
multiples of 256: a shape whose K is not is skipped for them (llama.cpp writes Q5_0 / Q8_0 there).

The machine may be shared: for every (type, shape) the bandwidth and the GEMV are timed alternately `--reps` times and
the best of each is kept, by wall time and by this thread's CPU time (time.thread_time, blind to preemption); the
ratios are those bests' quotients. Only ratios mean anything on a noisy machine.

    python scripts/bench_gguf_gemv.py                            # every type, both models, every x86 version
    python scripts/bench_gguf_gemv.py --types Q4_0 Q5_0 --models qwen2.5-0.5b --isa avx2
    python scripts/bench_gguf_gemv.py --types Q4_1 --models smollm2-135m --rows 4   # a batch of 4 (weight bytes/s)
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one compute thread, set before any OpenMP runtime starts
# The bound's buffer is a numpy array, which numpy puts in transparent huge pages; the weight copies sit in one
# huge-page region as the worker's GGUF weights do (workers/host_memory.py), and torch's other allocations get huge
# pages as in the engine's children (tokenmill/launcher.py). Until 2026-11-27 21:00 each copy was its own torch
# tensor, in huge pages only from 2 MiB up: the per-layer shapes of SmolLM2 (0.2-1.1 MB) were read from 4 KiB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse
import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.kernels import gguf_ops

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# (out_features, in_features) of each projection: SmolLM2-135M (hidden 576, 9 + 3 + 3 heads of 64, MLP 1536, vocab
# 49152) and Qwen2.5-0.5B (hidden 896, 14 + 2 + 2 heads of 64, MLP 4864, vocab 151936)
MODELS = {
    "smollm2-135m": {
        "qkv": (960, 576),
        "o_proj": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
    },
    "qwen2.5-0.5b": {
        "qkv": (1152, 896),
        "o_proj": (896, 896),
        "gate_up": (9728, 896),
        "down": (896, 4864),
        "lm_head": (151936, 896),
    },
}
# byte offsets of each block type's fp16 scales (d, and a min where there is one)
SCALE_OFFSETS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "IQ4_NL": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
STREAM_BYTES = 512 << 20
# the read loops tried for the bound: (isa, streams side by side, prefetch distance in bytes, 0 for none)
READ_STREAMS = (1, 2, 4, 8)
READ_PREFETCH = (0, 512, 2048)


@dataclass
class Best:
    """The best (shortest) wall and CPU seconds seen for one measurement."""

    wall: float = float("inf")
    cpu: float = float("inf")

    def time(self, fn: Callable[[], None]) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        self.wall = min(self.wall, time.perf_counter() - start)
        self.cpu = min(self.cpu, max(time.thread_time() - start_cpu, 1e-9))


def random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random quant bytes with small finite fp16 scales (timing needs valid numbers, not meaningful ones)."""
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(n, k // block_elems, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[type_name]:
        raw[:, :, offset : offset + 2] = (
            rng.uniform(0.0, 0.01, size=raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        )
    return raw.reshape(n, -1)


def weight_pool(type_name: str, n: int, k: int, pool_bytes: int, rng: np.random.Generator) -> tuple[list, bool]:
    """Copies of one random weight (as the engine lays it out) adding up to at least `pool_bytes`, and whether they
    are repacked."""
    import torch

    from tokenmill.workers.host_memory import huge_page_bytes

    qtype = int(GGMLQuantizationType[type_name])
    blocks = torch.from_numpy(random_blocks(type_name, n, k, rng))
    repacked = gguf_ops.repack_wanted(qtype, n)
    if repacked:
        blocks = gguf_ops.repack_rows(blocks, qtype, n, k)
    copies = max(2, -(-pool_bytes // blocks.numel()))
    # side by side in one huge-page region, as the worker gathers its GGUF weights (workers/host_memory.py)
    region = huge_page_bytes(copies * blocks.numel()).view(copies, *blocks.shape)
    region.copy_(blocks.expand(copies, *blocks.shape))
    return list(region.unbind(0)), repacked


@dataclass(frozen=True)
class ReadLoop:
    """One way to read the buffer: `tm_gguf_read_sum` with these loads, streams and prefetch, or (isa "legacy") the
    single-stream `tm_gguf_stream_sum`."""

    isa: str
    streams: int = 1
    prefetch: int = 0

    def run(self, lib: ctypes.CDLL, buffer: np.ndarray) -> None:
        if self.isa == "legacy":
            lib.tm_gguf_stream_sum(buffer.ctypes.data, buffer.nbytes)
            return
        code = gguf_ops.ISA_CODES[self.isa]
        if lib.tm_gguf_read_sum(code, buffer.ctypes.data, buffer.nbytes, self.streams, self.prefetch) == 0:
            raise ValueError(f"tm_gguf_read_sum refused {self}")

    def __str__(self) -> str:
        if self.isa == "legacy":
            return "tm_gguf_stream_sum (one stream, 64-bit words)"
        return f"{self.isa} loads, {self.streams} stream(s), prefetch {self.prefetch or 'none'}"


def fastest_read_loop(lib: ctypes.CDLL, buffer: np.ndarray, isas: list[str], reps: int) -> ReadLoop:
    """Every read loop timed (best of `reps`, by this thread's CPU time), printed; the fastest."""
    loops = [ReadLoop("legacy")] + [
        ReadLoop(isa, streams, prefetch) for isa in isas for streams in READ_STREAMS for prefetch in READ_PREFETCH
    ]
    rates: dict[ReadLoop, float] = {}
    for loop in loops:
        best = Best()
        for _ in range(reps):
            best.time(lambda loop=loop: loop.run(lib, buffer))
        rates[loop] = buffer.nbytes / best.cpu
    fastest = max(rates, key=lambda loop: rates[loop])
    print(f"read loops (GB/s per CPU-second, best of {reps}):")
    for loop, rate in rates.items():
        print(f"  {rate / 1e9:5.1f}  {loop}{'   <- the bound' if loop == fastest else ''}")
    return fastest


@dataclass
class Rates:
    """Best bytes per second of the stream read and of one type's GEMV on one shape, by wall and by CPU time."""

    stream_wall: float
    stream_cpu: float
    gemv_wall: float
    gemv_cpu: float
    repacked: bool


def measure(
    lib: ctypes.CDLL,
    stream: np.ndarray,
    bound: ReadLoop,
    type_name: str,
    n: int,
    k: int,
    args: argparse.Namespace,
    rng: np.random.Generator,
) -> Rates:
    """The stream and GEMV rates of one type and shape, timed alternately."""
    pool, repacked = weight_pool(type_name, n, k, int(args.pool_mb * 2**20), rng)
    pointers = (ctypes.c_void_p * len(pool))(*[blocks.data_ptr() for blocks in pool])
    x = rng.standard_normal(args.rows * k).astype(np.float32)
    y = np.empty(args.rows * n, dtype=np.float32)
    passes = max(1, int(args.min_bytes * 2**20 // (len(pool) * pool[0].numel())))
    calls = passes * len(pool)

    def gemv() -> None:
        status = lib.tm_gguf_matmul_cycle(
            int(GGMLQuantizationType[type_name]),
            int(repacked),
            x.ctypes.data,
            pointers,
            len(pool),
            calls,
            args.rows,
            n,
            k,
            y.ctypes.data,
        )
        if status != 0:
            raise ValueError(f"tm_gguf_matmul_cycle refused {type_name} {n}x{k}: {status}")

    bandwidth, kernel = Best(), Best()
    gemv()  # warm-up: page faults, scratch buffers
    for _ in range(args.reps):
        bandwidth.time(lambda: bound.run(lib, stream))
        kernel.time(gemv)
    weight_bytes = calls * pool[0].numel()
    return Rates(
        stream.nbytes / bandwidth.wall,
        stream.nbytes / bandwidth.cpu,
        weight_bytes / kernel.wall,
        weight_bytes / kernel.cpu,
        repacked,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--shapes", nargs="+", default=None, help="only these projections (qkv, o_proj, ...)")
    parser.add_argument(
        "--isa",
        nargs="+",
        default=None,
        help="versions to run (default: avx512 and avx2 where available, else the best one)",
    )
    parser.add_argument("--reps", type=int, default=5, help="alternated timings of bandwidth and GEMV, best kept")
    parser.add_argument("--pool-mb", type=float, default=128.0, help="weight bytes cycled through per GEMV timing")
    parser.add_argument("--min-bytes", type=float, default=256.0, help="MiB of weights read per GEMV timing")
    parser.add_argument(
        "--rows", type=int, default=1, help="activation rows per matmul (a decode batch; the target is for 1)"
    )
    args = parser.parse_args()

    lib = gguf_ops.library()
    if lib is None:
        raise SystemExit("the GGUF CPU kernels are not available here")
    available = gguf_ops.available_isas()
    isas = args.isa or [name for name in ("avx512", "avx2") if name in available] or [gguf_ops.isa()]
    stream = np.ones(STREAM_BYTES, dtype=np.uint8)
    rng = np.random.default_rng(0)
    bound = fastest_read_loop(lib, stream, [name for name in available if name != "neon"], args.reps)
    print(
        f"one thread; kernels available: {', '.join(available)}; ratio = GEMV weight bytes/s over the read "
        f"bound's bytes/s ({bound}), best of {args.reps} alternated timings (cpu: per CPU-second of this thread)"
    )
    print(
        f"{'isa':7} {'model':13} {'shape':8} {'N x K':>12} {'type':7} {'layout':8} {'MiB':>6} {'bound':>6} "
        f"{'GB/s':>6} {'ratio':>6} {'cpu ratio':>9}"
    )
    summary: dict[tuple[str, str], list[float]] = {}
    for isa in isas:
        gguf_ops.set_isa(isa)
        for model in args.models:
            for shape, (n, k) in MODELS[model].items():
                if args.shapes and shape not in args.shapes:
                    continue
                for type_name in args.types:
                    if k % GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]:
                        continue
                    rates = measure(lib, stream, bound, type_name, n, k, args, rng)
                    ratio, cpu_ratio = rates.gemv_wall / rates.stream_wall, rates.gemv_cpu / rates.stream_cpu
                    summary.setdefault((isa, type_name), []).append(cpu_ratio)
                    mib = n * gguf_ops.row_bytes(int(GGMLQuantizationType[type_name]), k) / 2**20
                    print(
                        f"{isa:7} {model:13} {shape:8} {f'{n} x {k}':>12} {type_name:7} "
                        f"{'repacked' if rates.repacked else 'plain':8} {mib:6.2f} "
                        f"{rates.stream_wall / 1e9:6.1f} {rates.gemv_wall / 1e9:6.1f} "
                        f"{ratio:6.2f} {cpu_ratio:9.2f}",
                        flush=True,
                    )
        gguf_ops.set_isa(None)
    print("\nworst cpu ratio over the shapes, per type and isa (>= 0.70 is the target)")
    for (isa, type_name), ratios in summary.items():
        print(f"{isa:7} {type_name:7} {min(ratios):5.2f}{'' if min(ratios) >= 0.7 else '  MISSED'}")


if __name__ == "__main__":
    main()
