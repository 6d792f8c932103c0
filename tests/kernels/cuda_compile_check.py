"""Compile every kernel ahead of time for real NVIDIA targets, without a GPU.

The interpreter runs kernels as numpy and accepts things the GPU compiler rejects (tile sizes
`tl.dot` cannot take, type mismatches in loops, unsupported control flow), so the tests also run
this script, with TRITON_INTERPRET unset, to push each kernel through Triton's full pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin via the bundled ptxas). Prints one line per kernel config
and exits non-zero on the first failure. Usage: python cuda_compile_check.py [sm ...]
"""

from __future__ import annotations

import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.kernels import fp8_gemm, kv_write, paged_attention, rms_norm, rotary, split_kv_decode

TYPES = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "fp8e4nv": "*fp8e4nv", "fp8e5": "*fp8e5"}
FP8_CAPABILITY = 89  # Triton converts to and from fp8 from sm_89 (Ada, Hopper) on


def compile_kernel(kernel, target: GPUTarget, pointers: dict[str, str], constexprs: dict, floats=()):
    """Compile `kernel` with pointer element types, constexpr values; other args are i32 scalars. A `num_warps` in
    `constexprs` is the launch option, not an argument."""
    constexprs = dict(constexprs)
    options = {"num_warps": constexprs.pop("num_warps")} if "num_warps" in constexprs else {}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options)


def attention_pointers(dtype: str, cache_dtype: str | None = None) -> dict[str, str]:
    ptr = TYPES[dtype]
    cache_ptr = TYPES[cache_dtype or dtype]
    return {
        "query_ptr": ptr,
        "k_cache_ptr": cache_ptr,
        "v_cache_ptr": cache_ptr,
        "out_ptr": ptr,
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32",
    }


def split_kv_configs(dtype: str, cache_dtype: str | None, common: dict, cache_label: str):
    """The split-KV decode kernels (partials and reduce) at 4 splits."""
    partial = dict(
        common,
        BLOCK_GROUP=split_kv_decode.decode_rows(common["GROUP"]),
        TILE_KEYS=split_kv_decode.DECODE_TILE_KEYS,
        NUM_SPLITS=4,
        SLIDING=True,
        num_warps=split_kv_decode.DECODE_NUM_WARPS,
    )
    pointers = dict(attention_pointers(dtype, cache_dtype), partial_out_ptr="*fp32", partial_lse_ptr="*fp32")
    label = f"{dtype}{cache_label} G{common['GROUP']} D{common['HEAD_DIM']}"
    yield (
        f"split_kv partial {label} BS{common['BLOCK_SIZE']}",
        split_kv_decode._split_kv_partial_kernel,
        pointers,
        partial,
        ("scale_log2", "v_scale"),
    )
    reduce = dict(NUM_SPLITS=4, BLOCK_SPLITS=4, HEAD_DIM=common["HEAD_DIM"], BLOCK_DIM=common["BLOCK_DIM"])
    pointers = {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "out_ptr": TYPES[dtype]}
    yield f"split_kv reduce {label}", split_kv_decode._split_kv_reduce_kernel, pointers, reduce, ()


def kernel_configs(capability: int):
    """(label, kernel, pointers, constexprs, float args) for each config worth compiling on `capability`: fp8 KV
    caches only where Triton has fp8 conversions."""
    attention_configs = [("fp16", 8, 128, 16, None), ("bf16", 3, 80, 32, None), ("fp32", 1, 64, 8, None)]
    if capability >= FP8_CAPABILITY:
        attention_configs.append(("bf16", 3, 64, 16, "fp8e4nv"))
    for dtype, group, head_dim, block_size, cache_dtype in attention_configs:
        common = dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_DIM=paged_attention._padded_dims(head_dim),
            BLOCK_SIZE=block_size,
            IEEE_DOT=dtype == "fp32",
        )
        decode = dict(
            common, BLOCK_GROUP=max(16, triton.next_power_of_2(group)), TILE_KEYS=paged_attention.DECODE_TILE_KEYS
        )
        cache_label = f" {cache_dtype} cache" if cache_dtype else ""
        yield (
            f"decode {dtype}{cache_label} G{group} D{head_dim} BS{block_size}",
            paged_attention._decode_kernel,
            attention_pointers(dtype, cache_dtype),
            decode,
            ("scale_log2", "v_scale"),
        )
        tokens_per_tile, block_rows = paged_attention.prefill_tile_shape(group)
        prefill = dict(
            common, TOKENS_PER_TILE=tokens_per_tile, BLOCK_ROWS=block_rows, TILE_KEYS=paged_attention.PREFILL_TILE_KEYS
        )
        yield (
            f"prefill {dtype}{cache_label} G{group} D{head_dim} BS{block_size}",
            paged_attention._prefill_kernel,
            attention_pointers(dtype, cache_dtype),
            prefill,
            ("scale_log2", "v_scale"),
        )
        yield from split_kv_configs(dtype, cache_dtype, common, cache_label)
    write_configs = [("fp16", 128, None), ("bf16", 80, None)]
    if capability >= FP8_CAPABILITY:
        write_configs += [("bf16", 64, "fp8e4nv"), ("fp32", 64, "fp8e5")]
    for dtype, head_dim, cache_dtype in write_configs:
        ptr, cache_ptr = TYPES[dtype], TYPES[cache_dtype or dtype]
        pointers = {
            "key_ptr": ptr,
            "value_ptr": ptr,
            "k_cache_ptr": cache_ptr,
            "v_cache_ptr": cache_ptr,
            "slot_mapping_ptr": "*i64",
        }
        constexprs = dict(
            NUM_KV_HEADS=3,
            HEAD_DIM=head_dim,
            BLOCK_HEADS=4,
            BLOCK_DIM=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=16,
            FP8=cache_dtype is not None,
            SATURATE_AT=448.0 if cache_dtype == "fp8e4nv" else 0.0,  # kv_quant.saturation_bound
        )
        yield (
            f"write_kv {dtype}{f' {cache_dtype} cache' if cache_dtype else ''} D{head_dim}",
            kv_write._write_kv_kernel,
            pointers,
            constexprs,
            ("k_scale", "v_scale"),
        )
    for dtype, hidden, residual in [("bf16", 4096, True), ("fp16", 576, False)]:
        ptr = TYPES[dtype]
        pointers = {"x_ptr": ptr, "residual_ptr": ptr, "weight_ptr": ptr, "out_ptr": ptr, "residual_out_ptr": ptr}
        constexprs = dict(HIDDEN=hidden, BLOCK_HIDDEN=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual)
        yield (
            f"rms_norm {dtype} H{hidden} residual={residual}",
            rms_norm._rms_norm_kernel,
            pointers,
            constexprs,
            ("eps",),
        )
    for dtype, neox, rot_dim in [("fp16", True, 128), ("bf16", False, 64)]:
        ptr = TYPES[dtype]
        pointers = {
            "q_ptr": ptr,
            "k_ptr": ptr,
            "q_out_ptr": ptr,
            "k_out_ptr": ptr,
            "positions_ptr": "*i64",
            "cos_sin_ptr": "*fp32",
        }
        constexprs = dict(
            NUM_Q_HEADS=9,
            NUM_K_HEADS=3,
            BLOCK_Q_HEADS=16,
            BLOCK_K_HEADS=4,
            HEAD_DIM=128,
            BLOCK_DIM=128,
            HALF_ROT=rot_dim // 2,
            BLOCK_HALF=rot_dim // 2,
            NEOX_STYLE=neox,
            COPY_TAIL=rot_dim < 128,
        )
        yield f"rotary {dtype} neox={neox} rot{rot_dim}", rotary._rotary_kernel, pointers, constexprs, ()
    if capability >= FP8_CAPABILITY:  # the W8A8 path: fp8 operands on the tensor cores, precise accumulation
        pointers = {"x_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32"}
        constexprs = dict(FP8_DOT=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, IEEE_DOT=False)
        yield "fp8_gemm w8a8 fp32 out", fp8_gemm._fp8_gemm_kernel, {**pointers, "out_ptr": "*fp32"}, constexprs, ()


def main(capabilities: list[int]) -> int:
    for capability in capabilities:
        target = GPUTarget("cuda", capability, 32)
        for label, kernel, pointers, constexprs, floats in kernel_configs(capability):
            start = time.perf_counter()
            compiled = compile_kernel(kernel, target, pointers, constexprs, floats)
            assert compiled.asm.get("cubin"), f"{label}: no cubin"
            if label.startswith("fp8_gemm"):  # precise accumulation: no fp8 wgmma summing all of K in fp8's MMA
                assert "e4m3.e4m3" not in compiled.asm["ptx"], f"{label}: fp8 MMA accumulating imprecisely"
            shared = compiled.metadata.shared
            print(f"sm_{capability} {label}: ok, {shared} B shared, {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main([int(arg) for arg in sys.argv[1:]] or [90]))
