"""GGUF CPU matmul kernels (kernels/gguf_ops.py): weight bytes read per second at batch 1 against the machine's
memory bandwidth, and the batch-32 time against 32 batch-1 calls.

Every matrix is cycled through a pool of copies at least `--pool-mb` large, so each call reads its weights from
memory, not from the last-level cache. Bandwidth is a torch read-sum of a 512 MiB tensor at the same thread count.
On a shared, oversubscribed machine wall time measures the neighbours as much as the kernel: at one thread the
table also gives rates per CPU-second of this thread (time.thread_time), for the kernel and the read-sum alike.

    python scripts/bench_gguf_kernels.py --threads 1 2
    python scripts/bench_gguf_kernels.py --types Q4_0 Q6_K --isa avx2
    python scripts/bench_gguf_kernels.py --types Q4_1 --activations float int8 --shapes "mlp_up 1536x576"

Each mode of `--activations` gets a row; with both, a `float/int8` line gives the float path's time over the int8
path's at batch 1 and at the batch size (CPU time at one thread, wall time otherwise), measured back to back.

`--repack` instead compares the plain int8 kernel with the repacked one (gguf_ops.repack_rows; gguf_ops.REPACK_TYPES) at
each `--tokens` count of activation rows, back to back: both times, plain/repacked, and each layout's time over its
own 1-row time (the cost of verifying T speculative tokens against decoding one):

    python scripts/bench_gguf_kernels.py --repack --threads 1 --types Q4_1 --shapes "qkv 960x576" "o_proj 576x576" \
        "gate_up 3072x576" "mlp_down 576x1536"
    python scripts/bench_gguf_kernels.py --repack --threads 1 --types Q8_0 --shapes "lm_head 49152x576"
    python scripts/bench_gguf_kernels.py --repack --threads 1 --types Q4_K --shapes "qwen_down 896x4864" --tokens 1 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.kernels import gguf_ops

SHAPES = {
    "mlp_up 1536x576": (1536, 576),
    "mlp_down 576x1536": (576, 1536),
    "lm_head 49152x576": (49152, 576),
    "big 16384x1536": (16384, 1536),  # an LM-head-sized matrix whose K suits the k-quants too
    # the default model's fused projections (SmolLM2-135M: hidden 576, 9 + 3 + 3 heads of 64, MLP 1536)
    "qkv 960x576": (960, 576),
    "o_proj 576x576": (576, 576),
    "gate_up 3072x576": (3072, 576),
}
# Qwen2.5-0.5B's (hidden 896, MLP 4864; its Q4_K_M file holds Q5_0, Q8_0, Q4_K and Q6_K): by name only, not by default
QWEN_SHAPES = {
    "qwen_qkv 1152x896": (1152, 896),
    "qwen_o_proj 896x896": (896, 896),
    "qwen_gate_up 9728x896": (9728, 896),
    "qwen_down 896x4864": (896, 4864),
}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with small finite fp16 scales where each block type keeps them (timing does not need more)."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block_elems, block_bytes), dtype=np.uint8)
    scale_offsets = {
        GGMLQuantizationType.Q4_0: [0],
        GGMLQuantizationType.Q8_0: [0],
        GGMLQuantizationType.Q4_1: [0, 2],
        GGMLQuantizationType.Q2_K: [80, 82],
        GGMLQuantizationType.Q3_K: [108],
        GGMLQuantizationType.Q4_K: [0, 2],
        GGMLQuantizationType.Q5_K: [0, 2],
        GGMLQuantizationType.Q6_K: [208],
    }[qtype]
    for offset in scale_offsets:
        halves = rng.uniform(-0.01, 0.01, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, offset : offset + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def seconds_per_call(fn, pool_size: int, min_seconds: float) -> tuple[float, float]:
    """Medians over repeats of the wall and this-thread CPU time per call, cycling through the pool."""
    fn(0)
    wall, cpu = [], []
    deadline = time.perf_counter() + min_seconds
    i = 0
    while time.perf_counter() < deadline or len(wall) < 5:
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(pool_size):
            fn(i % pool_size)
            i += 1
        wall.append((time.perf_counter() - start) / pool_size)
        cpu.append((time.thread_time() - start_cpu) / pool_size)
    return float(np.median(wall)), float(np.median(cpu))


def read_bandwidth() -> tuple[float, float]:
    """Best of five torch read-sums of 512 MiB: (bytes per wall second, bytes per CPU second of this thread)."""
    big = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best, best_cpu = 0.0, 0.0
    for _ in range(5):
        start, start_cpu = time.perf_counter(), time.thread_time()
        big.sum()
        best = max(best, big.numel() * 4 / (time.perf_counter() - start))
        best_cpu = max(best_cpu, big.numel() * 4 / max(time.thread_time() - start_cpu, 1e-9))
    return best, best_cpu


def compare_repacked(args: argparse.Namespace, threads: int, rng: np.random.Generator) -> None:
    """Plain against repacked int8 kernels at each token count (CPU time at one thread, wall time otherwise)."""
    tokens = args.tokens
    print(
        f"{'type':6} {'shape':20} {'T':>3} {'plain us':>9} {'repack us':>9} {'plain/rep':>9} "
        f"{'plain/T1':>8} {'rep/T1':>7}"
    )
    for type_name in args.types:
        qtype = GGMLQuantizationType[type_name]
        if int(qtype) not in gguf_ops.REPACK_TYPES:
            print(f"{type_name:6} (no repacked layout)")
            continue
        for shape_name in args.shapes:
            n, k = {**SHAPES, **QWEN_SHAPES}[shape_name]
            one = torch.from_numpy(random_blocks(qtype, n, k, rng))
            copies = max(1, int(args.pool_mb * 1e6 // one.numel()))
            plain = [one] + [one.clone() for _ in range(copies - 1)]
            packed = [gguf_ops.repack_rows(blocks, int(qtype), n, k) for blocks in plain]
            first = {}
            for t in tokens:
                x = torch.randn(t, k)
                times = []
                for pool, repacked in ((plain, False), (packed, True)):
                    wall, cpu = seconds_per_call(
                        lambda i, x=x, pool=pool, qtype=qtype, n=n, k=k, repacked=repacked: gguf_ops.gguf_matmul(
                            x, pool[i], int(qtype), n, k, activations="int8", repacked=repacked
                        ),
                        copies,
                        args.seconds,
                    )
                    times.append(cpu if threads == 1 else wall)
                first.setdefault("plain", times[0])
                first.setdefault("repacked", times[1])
                print(
                    f"{type_name:6} {shape_name:20} {t:3d} {times[0] * 1e6:9.1f} {times[1] * 1e6:9.1f} "
                    f"{times[0] / times[1]:9.2f} {times[0] / first['plain']:8.2f} {times[1] / first['repacked']:7.2f}"
                )
            del plain, packed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=[*SHAPES, *QWEN_SHAPES])
    parser.add_argument("--isa", default=None, help="force a version (scalar, avx2, avx512, neon)")
    parser.add_argument("--pool-mb", type=float, default=96.0, help="weight bytes cycled through per matrix")
    parser.add_argument("--batch", type=int, default=32, help="the batch compared with that many batch-1 calls")
    parser.add_argument("--seconds", type=float, default=0.5, help="minimum timing per figure")
    parser.add_argument(
        "--activations",
        nargs="+",
        default=list(gguf_ops.ACTIVATION_MODES),
        choices=list(gguf_ops.ACTIVATION_MODES),
        help="gguf_matmul's activation modes to time",
    )
    parser.add_argument("--repack", action="store_true", help="compare the plain and the repacked int8 kernels")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="activation rows for --repack (the first is the ratios' base)",
    )
    args = parser.parse_args()

    gguf_ops.set_isa(args.isa) if args.isa else None
    print(f"kernels: {gguf_ops.isa()} (available: {', '.join(gguf_ops.available_isas())})")
    rng = np.random.default_rng(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth, bandwidth_cpu = read_bandwidth()
        print(
            f"\nthreads={threads}  memory read bandwidth (torch sum): {bandwidth / 1e9:.1f} GB/s wall"
            + (f", {bandwidth_cpu / 1e9:.1f} GB/s per CPU-second" if threads == 1 else "")
        )
        if args.repack:
            compare_repacked(args, threads, rng)
            continue
        print(
            f"{'type':6} {'shape':20} {'act':5} {'bytes':>9} {'b1 us':>8} {'GB/s':>6} {'% bw':>5} "
            + (f"{'cpu us':>8} {'GB/s':>6} {'% bw':>5} " if threads == 1 else "")
            + f"{'b' + str(args.batch) + ' us':>10} {'vs ' + str(args.batch) + 'xb1':>8}"
        )
        for type_name in args.types:
            qtype = GGMLQuantizationType[type_name]
            for shape_name in args.shapes:
                n, k = {**SHAPES, **QWEN_SHAPES}[shape_name]
                if k % GGML_QUANT_SIZES[qtype][0]:
                    print(f"{type_name:6} {shape_name:20} (K={k} is not a whole number of {type_name} blocks)")
                    continue
                one = torch.from_numpy(random_blocks(qtype, n, k, rng))
                copies = max(1, int(args.pool_mb * 1e6 // one.numel()))
                pool = [one] + [one.clone() for _ in range(copies - 1)]
                x1 = torch.randn(1, k)
                xb = torch.randn(args.batch, k)
                times = {}
                for mode in args.activations:
                    t1, c1 = seconds_per_call(
                        lambda i, x1=x1, pool=pool, qtype=qtype, n=n, k=k, mode=mode: gguf_ops.gguf_matmul(
                            x1, pool[i], int(qtype), n, k, activations=mode
                        ),
                        copies,
                        args.seconds,
                    )
                    tb, cb = seconds_per_call(
                        lambda i, xb=xb, pool=pool, qtype=qtype, n=n, k=k, mode=mode: gguf_ops.gguf_matmul(
                            xb, pool[i], int(qtype), n, k, activations=mode
                        ),
                        copies,
                        args.seconds,
                    )
                    rate, rate_cpu = one.numel() / t1, one.numel() / c1
                    line = (
                        f"{type_name:6} {shape_name:20} {mode:5} {one.numel():9d} {t1 * 1e6:8.1f} "
                        f"{rate / 1e9:6.2f} {100 * rate / bandwidth:4.0f}% "
                    )
                    if threads == 1:  # batch ratio from CPU time too: both are one thread's work
                        line += f"{c1 * 1e6:8.1f} {rate_cpu / 1e9:6.2f} {100 * rate_cpu / bandwidth_cpu:4.0f}% "
                        line += f"{cb * 1e6:10.1f} {cb / (args.batch * c1):8.3f}"
                        times[mode] = (c1, cb)
                    else:
                        line += f"{tb * 1e6:10.1f} {tb / (args.batch * t1):8.3f}"
                        times[mode] = (t1, tb)
                    print(line)
                if len(times) == 2:
                    print(
                        f"{'':27} float/int8: b1 {times['float'][0] / times['int8'][0]:.2f}x, "
                        f"b{args.batch} {times['float'][1] / times['int8'][1]:.2f}x"
                    )
                del pool


if __name__ == "__main__":
    main()
