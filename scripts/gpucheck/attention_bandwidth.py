"""(d) Decode-attention bandwidth: the old one-program-per-(sequence, kv head) kernel and the split-KV kernel over a
paged bf16 cache at batch 1/32/256 and context 1k/8k, as a fraction of a device-to-device copy timed in the same run.

Bytes counted: K and V read once, the query read and the output written; the copy counts bytes read plus written.
Shapes are Llama-3-8B's attention (32 query heads, 8 kv heads, head dim 128), blocks of 16, tables shuffled. Each
size's outputs are checked against the float64 reference (relative L2 error) where the reference is cheap.
"""

from __future__ import annotations

import math

import torch

from gpucheck.common import CheckContext, SectionResult, median_time_s

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MAX_RELATIVE_ERROR = 1e-2  # bf16 operands
REFERENCE_MAX_KEYS = 64 * 1024  # batch x context up to which the (per-sequence, float64) reference runs


def copy_bandwidth_gbps(device: str, num_bytes: int) -> float:
    src = torch.randn(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = median_time_s(lambda: dst.copy_(src), device, repeats=5)
    return 2 * num_bytes / seconds / 1e9


def paged_inputs(batch: int, context: int, device: str, shape: tuple[int, int, int], dtype: torch.dtype) -> tuple:
    num_q_heads, num_kv_heads, head_dim = shape
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    cache_shape = (batch * blocks_per_seq, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    tables = torch.randperm(batch * blocks_per_seq, device=device).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_q_heads, head_dim, dtype=dtype, device=device)
    return query, k_cache, v_cache, tables, seq_lens, head_dim**-0.5


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def measure_size(ctx: CheckContext, batch: int, context: int, copy_gbps: float, num_sms: int) -> dict:
    from tokenmill.kernels.paged_attention import paged_attention_decode
    from tokenmill.kernels.split_kv_decode import choose_num_splits, split_kv_decode, split_kv_decode_ref

    shape = ctx.pick((NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM), (4, 2, 32))
    # The interpreter multiplies bf16 dot operands wrongly (tests/kernels/conftest.py patches it for the tests), so
    # a dry run uses float32.
    args = paged_inputs(batch, context, ctx.device, shape, ctx.pick(torch.bfloat16, torch.float32))
    num_splits = choose_num_splits(batch, shape[1], context, num_sms)
    kernels = {
        "old": lambda: paged_attention_decode(*args),
        "split_kv": lambda: split_kv_decode(*args, num_splits=num_splits),
    }
    moved = args[1].element_size() * (2 * batch * context * shape[1] * shape[2] + 2 * args[0].numel())
    row: dict = {"batch": batch, "context": context, "num_splits": num_splits}
    reference = split_kv_decode_ref(*args) if batch * context <= REFERENCE_MAX_KEYS else None
    for name, kernel in kernels.items():
        if reference is not None:
            row[f"{name}_relative_error"] = relative_error(kernel(), reference)
        seconds = median_time_s(kernel, ctx.device, repeats=3)
        row[f"{name}_us"] = seconds * 1e6
        row[f"{name}_gbps"] = moved / seconds / 1e9
        row[f"{name}_fraction_of_copy"] = row[f"{name}_gbps"] / copy_gbps
    return row


def run(ctx: CheckContext) -> SectionResult:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if ctx.device == "cuda" else 132
    copy_gbps = copy_bandwidth_gbps(ctx.device, ctx.pick(2 << 30, 1 << 20))
    rows = []
    for context in ctx.pick((1024, 8192), (40, 300)):
        for batch in ctx.pick((1, 32, 256), (1, 2)):
            rows.append(measure_size(ctx, batch, context, copy_gbps, num_sms))
            ctx.save_partial({"copy_gbps": copy_gbps, "num_sms": num_sms, "sizes": rows})
    errors = [value for row in rows for key, value in row.items() if key.endswith("relative_error")]
    passed = all(error < MAX_RELATIVE_ERROR for error in errors)
    summary = [
        f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write); {num_sms} SMs",
        "",
        "| batch | context | splits | old GB/s | old / copy | split-KV GB/s | split-KV / copy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary += [
        f"| {r['batch']} | {r['context']} | {r['num_splits']} | {r['old_gbps']:.0f} | "
        f"{r['old_fraction_of_copy']:.0%} | {r['split_kv_gbps']:.0f} | {r['split_kv_fraction_of_copy']:.0%} |"
        for r in rows
    ]
    summary += ["", f"largest relative error vs float64: {max(errors, default=float('nan')):.2e}"]
    return SectionResult(passed, {"copy_gbps": copy_gbps, "num_sms": num_sms, "sizes": rows}, summary)
