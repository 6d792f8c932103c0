"""Benchmark the Triton kernels on a CUDA GPU.

Decode attention is memory-bound, so it is reported as achieved bandwidth (bytes of K/V, query,
output and block table moved per second) and as a fraction of the GPU's peak HBM bandwidth (from a
table of known devices, or --peak-tbps). The other kernels are timed against their torch
references; the int4 (AWQ/GPTQ) and FP8 GEMMs against torch's dense matmul of the same weight. Each kernel's
output is first checked against its reference on the same inputs.
On a machine without CUDA it says so and exits 0.

    python scripts/bench_kernels.py [--dtype bf16] [--batch-sizes 1,8,32,128] [--context-len 1024]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

# Peak HBM bandwidth in TB/s, matched in order against torch.cuda.get_device_name().
PEAK_TBPS_BY_DEVICE = [
    ("GH200", 4.0),
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 3.35),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),  # 40 GB SXM and PCIe
    ("L40S", 0.864),
    ("L40", 0.864),
    ("A10G", 0.6),
    ("A10", 0.6),
    ("L4", 0.3),
    ("RTX 4090", 1.008),
    ("RTX 3090", 0.936),
]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@dataclass
class Result:
    kernel: str
    config: str
    kernel_us: float
    reference_us: float | None = None
    gbps: float | None = None
    peak_fraction: float | None = None
    matches_reference: bool | None = None


def peak_tbps(device_name: str) -> float | None:
    for fragment, tbps in PEAK_TBPS_BY_DEVICE:
        if fragment in device_name:
            return tbps
    return None


def time_us(fn: Callable[[], object], iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def close(a, b, dtype: torch.dtype) -> bool:
    if isinstance(a, tuple):
        return all(close(x, y, dtype) for x, y in zip(a, b))
    tol = TOLERANCE[dtype]
    return bool(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol))


def paged_cache(batch: int, context_len: int, args, dtype: torch.dtype):
    blocks_per_seq = math.ceil(context_len / args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context_len, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, block_tables, seq_lens


def bench_decode(args, dtype: torch.dtype, peak: float | None) -> list[Result]:
    from tokenmill.kernels.paged_attention import paged_attention_decode, paged_attention_decode_ref

    results = []
    elem = torch.tensor([], dtype=dtype).element_size()
    for batch in args.batch_sizes:
        k_cache, v_cache, tables, seq_lens = paged_cache(batch, args.context_len, args, dtype)
        query = torch.randn(batch, args.num_q_heads, args.head_dim, dtype=dtype, device="cuda")
        call_args = (query, k_cache, v_cache, tables, seq_lens, args.head_dim**-0.5)
        matches = close(paged_attention_decode(*call_args), paged_attention_decode_ref(*call_args), dtype)
        kernel_us = time_us(lambda call_args=call_args: paged_attention_decode(*call_args), args.iters)
        reference_us = time_us(lambda call_args=call_args: paged_attention_decode_ref(*call_args), 3, warmup=1)
        kv_bytes = 2 * int(seq_lens.sum()) * args.num_kv_heads * args.head_dim * elem
        moved = kv_bytes + 2 * query.numel() * elem + tables.numel() * 4 + seq_lens.numel() * 4
        gbps = moved / kernel_us / 1e3
        config = f"B={batch} ctx={args.context_len} Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim}"
        fraction = gbps / (peak * 1e3) if peak else None
        results.append(Result("paged_attention_decode", config, kernel_us, reference_us, gbps, fraction, matches))
    return results


def bench_others(args, dtype: torch.dtype) -> list[Result]:
    from tokenmill.kernels.kv_write import write_kv, write_kv_ref
    from tokenmill.kernels.paged_attention import paged_attention_prefill, paged_attention_prefill_ref
    from tokenmill.kernels.rms_norm import rms_norm, rms_norm_ref
    from tokenmill.kernels.rotary import apply_rotary, apply_rotary_ref, rotary_cos_sin_cache

    results = []
    tokens, hidden = args.tokens, args.num_q_heads * args.head_dim

    def compare(name: str, config: str, kernel: Callable, reference: Callable, check: bool = True) -> None:
        matches = close(kernel(), reference(), dtype) if check else None
        kernel_us, reference_us = time_us(kernel, args.iters), time_us(reference, args.iters)
        results.append(Result(name, config, kernel_us, reference_us, matches_reference=matches))

    # Prefill: 4 sequences, each a chunk of tokens//4 new tokens after as many cached ones.
    num_seqs, q_len = 4, args.tokens // 4
    k_cache, v_cache, tables, seq_lens = paged_cache(num_seqs, 2 * q_len, args, dtype)
    query = torch.randn(num_seqs * q_len, args.num_q_heads, args.head_dim, dtype=dtype, device="cuda")
    starts = torch.arange(0, num_seqs + 1, dtype=torch.int32, device="cuda") * q_len
    prefill_args = (query, k_cache, v_cache, tables, starts, seq_lens, args.head_dim**-0.5)
    compare(
        "paged_attention_prefill",
        f"B={num_seqs} q_len={q_len} ctx={2 * q_len}",
        lambda: paged_attention_prefill(*prefill_args),
        lambda: paged_attention_prefill_ref(*prefill_args),
    )

    key = torch.randn(tokens, args.num_kv_heads, args.head_dim, dtype=dtype, device="cuda")
    slots = torch.randperm(k_cache.shape[0] * args.block_size, device="cuda")[:tokens]
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    compare(
        "write_kv",
        f"T={tokens}",
        lambda: (write_kv(key, key, k_cache, v_cache, slots), k_cache)[1],
        lambda: (write_kv_ref(key, key, k_copy, v_copy, slots), k_copy)[1],
    )

    x, residual = (torch.randn(tokens, hidden, dtype=dtype, device="cuda") for _ in range(2))
    weight = torch.randn(hidden, dtype=dtype, device="cuda")
    compare(
        "rms_norm+residual",
        f"T={tokens} H={hidden}",
        lambda: rms_norm(x, weight, 1e-6, residual),
        lambda: rms_norm_ref(x, weight, 1e-6, residual),
    )

    q = torch.randn(tokens, args.num_q_heads, args.head_dim, dtype=dtype, device="cuda")
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cos_sin = rotary_cos_sin_cache(args.head_dim, 8192).cuda()
    compare(
        "apply_rotary",
        f"T={tokens} Hq={args.num_q_heads} Hkv={args.num_kv_heads}",
        lambda: apply_rotary(q, key, positions, cos_sin),
        lambda: apply_rotary_ref(q, key, positions, cos_sin),
    )

    return results


def bench_quantized_gemm(args, dtype: torch.dtype, peak: float | None) -> list[Result]:
    """Weight-only int4 (AWQ, GPTQ, GPTQ act-order) and FP8 GEMMs on one `--gemm-k` x `--gemm-n` linear layer per
    batch size, against torch's dense matmul of the same (dequantized) weight. Bandwidth counts the bytes the kernel
    must read (packed weights, scales, zeros, x, out): small batches are memory-bound, so that is the figure to
    watch."""
    from tokenmill.kernels.fp8_gemm import FP8_DTYPE, fp8_gemm, fp8_gemm_ref, pick_method
    from tokenmill.kernels.int4_gemm import awq_dequantize_ref, awq_gemm, gptq_dequantize_ref, gptq_gemm

    k, n, group = args.gemm_k, args.gemm_n, 128
    if dtype == torch.float32:
        return []  # the quantized formats run fp16/bf16 activations

    def random_int32(*shape):
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device="cuda")

    scales = (torch.rand(k // group, n, device="cuda") * 2e-3).half()
    qzeros = random_int32(k // group, n // 8)
    awq_qweight, gptq_qweight = random_int32(k, n // 8), random_int32(k // 8, n)
    g_idx = (torch.randperm(k, device="cuda") // group).to(torch.int32)
    fp8_weight = (torch.randn(n, k, device="cuda") * 0.02).to(FP8_DTYPE)
    fp8_scale = torch.rand(n, device="cuda") * 1e-2 + 1e-3
    int4_bytes = k * n // 2 + scales.nbytes + qzeros.nbytes
    cases = [
        (
            "awq_gemm",
            int4_bytes,
            lambda x: awq_gemm(x, awq_qweight, qzeros, scales, group),
            awq_dequantize_ref(awq_qweight, qzeros, scales, group, dtype),
        ),
        (
            "gptq_gemm",
            int4_bytes,
            lambda x: gptq_gemm(x, gptq_qweight, qzeros, scales, group),
            gptq_dequantize_ref(gptq_qweight, qzeros, scales, group, None, 1, dtype),
        ),
        (
            "gptq_gemm act-order",
            int4_bytes + 4 * k,
            lambda x: gptq_gemm(x, gptq_qweight, qzeros, scales, group, g_idx),
            gptq_dequantize_ref(gptq_qweight, qzeros, scales, group, g_idx, 1, dtype),
        ),
        (
            "fp8_gemm",
            k * n + 4 * n,
            lambda x: fp8_gemm(x, fp8_weight, fp8_scale),
            (fp8_weight.float() * fp8_scale[:, None]).to(dtype).T,
        ),
    ]
    results = []
    for batch in args.batch_sizes:
        x = torch.randn(batch, k, dtype=dtype, device="cuda")
        for name, weight_bytes, kernel, dense in cases:
            if name == "fp8_gemm":  # W8A8 quantizes x: compare with the same quantized input
                check = close(kernel(x), fp8_gemm_ref(x, fp8_weight, fp8_scale, dtype=torch.float32), dtype)
                label = f"fp8 {pick_method(x, n)}"
            else:
                check = close(kernel(x), x @ dense, dtype)
                label = name
            kernel_us = time_us(lambda kernel=kernel, x=x: kernel(x), args.iters)
            reference_us = time_us(lambda x=x, dense=dense: x @ dense, args.iters)
            gbps = (weight_bytes + 2 * batch * (k + n) * x.element_size()) / kernel_us / 1e3
            results.append(
                Result(
                    label,
                    f"M={batch} K={k} N={n} G={group}",
                    kernel_us,
                    reference_us,
                    gbps,
                    gbps / (peak * 1e3) if peak else None,
                    check,
                )
            )
    return results


def print_table(results: list[Result]) -> None:
    header = f"{'kernel':26} {'config':44} {'kernel us':>10} {'torch us':>10} {'x':>6} {'GB/s':>8} {'peak':>6}  ok"
    print(header)
    print("-" * len(header))
    for r in results:
        ref = f"{r.reference_us:10.1f}" if r.reference_us else f"{'':>10}"
        speedup = f"{r.reference_us / r.kernel_us:6.1f}" if r.reference_us else f"{'':>6}"
        gbps = f"{r.gbps:8.0f}" if r.gbps else f"{'':>8}"
        peak = f"{r.peak_fraction:6.1%}" if r.peak_fraction else f"{'':>6}"
        ok = {True: "ok", False: "MISMATCH", None: "-"}[r.matches_reference]
        print(f"{r.kernel:26} {r.config:44} {r.kernel_us:10.1f} {ref} {speedup} {gbps} {peak}  {ok}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128])
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens for prefill/write/norm/rotary")
    parser.add_argument("--gemm-k", type=int, default=4096, help="in features of the quantized GEMMs' layer")
    parser.add_argument("--gemm-n", type=int, default=14336, help="out features of the quantized GEMMs' layer")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--peak-tbps", type=float, default=None, help="override the device's peak HBM TB/s")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU (the kernels run here only under TRITON_INTERPRET, too slow to time).")
        return 0
    device_name = torch.cuda.get_device_name()
    peak = args.peak_tbps or peak_tbps(device_name)
    peak_text = f"{peak} TB/s" if peak else "unknown (pass --peak-tbps)"
    print(f"device: {device_name}, peak HBM bandwidth: {peak_text}, dtype: {args.dtype}\n")
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    results = bench_decode(args, dtype, peak) + bench_others(args, dtype) + bench_quantized_gemm(args, dtype, peak)
    print_table(results)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"device": device_name, "peak_tbps": peak, "results": [asdict(r) for r in results]}, out, indent=2
            )
    return 0 if all(r.matches_reference is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
