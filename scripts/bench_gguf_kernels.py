"""GGUF CPU matmul kernels (kernels/gguf_ops.py): weight bytes read per second at batch 1 against the machine's
memory bandwidth, and the batch-32 time against 32 batch-1 calls.

Every matrix is cycled through a pool of copies at least `--pool-mb` large, so each call reads its weights from
memory, not from the last-level cache. Bandwidth is a torch read-sum of a 512 MiB tensor at the same thread count.

    python scripts/bench_gguf_kernels.py --threads 1 2
    python scripts/bench_gguf_kernels.py --types Q4_0 Q6_K --isa avx2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.kernels import gguf_ops

SHAPES = {"mlp_up 1536x576": (1536, 576), "mlp_down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with small finite fp16 scales where each block type keeps them (timing does not need more)."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block_elems, block_bytes), dtype=np.uint8)
    scale_offsets = {GGMLQuantizationType.Q4_0: [0], GGMLQuantizationType.Q8_0: [0], GGMLQuantizationType.Q4_1: [0, 2],
                     GGMLQuantizationType.Q4_K: [0, 2], GGMLQuantizationType.Q5_K: [0, 2],
                     GGMLQuantizationType.Q6_K: [208]}[qtype]
    for offset in scale_offsets:
        halves = rng.uniform(-0.01, 0.01, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, offset:offset + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def seconds_per_call(fn, pool_size: int, min_seconds: float) -> float:
    """Median over repeats of the time per call, cycling through the pool."""
    fn(0)
    samples = []
    deadline = time.perf_counter() + min_seconds
    i = 0
    while time.perf_counter() < deadline or len(samples) < 5:
        start = time.perf_counter()
        for _ in range(pool_size):
            fn(i % pool_size)
            i += 1
        samples.append((time.perf_counter() - start) / pool_size)
    return float(np.median(samples))


def read_bandwidth() -> float:
    big = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        best = max(best, big.numel() * 4 / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--isa", default=None, help="force a version (scalar, avx2, avx512, neon)")
    parser.add_argument("--pool-mb", type=float, default=96.0, help="weight bytes cycled through per matrix")
    parser.add_argument("--batch", type=int, default=32, help="the batch compared with that many batch-1 calls")
    parser.add_argument("--seconds", type=float, default=0.5, help="minimum timing per figure")
    args = parser.parse_args()

    gguf_ops.set_isa(args.isa) if args.isa else None
    print(f"kernels: {gguf_ops.isa()} (available: {', '.join(gguf_ops.available_isas())})")
    rng = np.random.default_rng(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = read_bandwidth()
        print(f"\nthreads={threads}  memory read bandwidth (torch sum) {bandwidth / 1e9:.1f} GB/s")
        print(f"{'type':6} {'shape':20} {'bytes':>9} {'b1 us':>9} {'b1 GB/s':>8} {'% bw':>6} "
              f"{'b' + str(args.batch) + ' us':>10} {'vs ' + str(args.batch) + 'xb1':>8}")
        for type_name in args.types:
            qtype = GGMLQuantizationType[type_name]
            for shape_name in args.shapes:
                n, k = SHAPES[shape_name]
                one = torch.from_numpy(random_blocks(qtype, n, k, rng))
                copies = max(1, int(args.pool_mb * 1e6 // one.numel()))
                pool = [one] + [one.clone() for _ in range(copies - 1)]
                x1 = torch.randn(1, k)
                xb = torch.randn(args.batch, k)
                t1 = seconds_per_call(lambda i: gguf_ops.gguf_matmul(x1, pool[i], int(qtype), n, k), copies,
                                      args.seconds)
                tb = seconds_per_call(lambda i: gguf_ops.gguf_matmul(xb, pool[i], int(qtype), n, k), copies,
                                      args.seconds)
                rate = one.numel() / t1
                print(f"{type_name:6} {shape_name:20} {one.numel():9d} {t1 * 1e6:9.1f} {rate / 1e9:8.2f} "
                      f"{100 * rate / bandwidth:5.0f}% {tb * 1e6:10.1f} {tb / (args.batch * t1):8.3f}")
                del pool


if __name__ == "__main__":
    main()
