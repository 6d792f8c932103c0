"""Scatter this step's new keys and values into the paged KV cache.

Cache layout (shared with `workers/attention.py`): per layer a K and a V cache, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token t goes to flat slot
`slot_mapping[t] = block_id * block_size + offset`; slot -1 marks a padding token that is skipped.
The Triton kernel runs one program per token and writes all of its kv heads at once.

An fp8 cache (`kernels/kv_quant.py`) stores `key / k_scale` and `value / v_scale`, divided in float32 and rounded
to nearest even with saturation; any other cache stores the values cast to its dtype and ignores the scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_quant import is_fp8, quantize, saturation_bound


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_k_block,
    stride_k_offset,
    stride_k_head,
    stride_v_block,
    stride_v_offset,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    SATURATE_AT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_DIM)
    # slot < 0 is padding: zero heads to write turns the whole program into a no-op.
    heads_to_write = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < heads_to_write) & (dims[None, :] < HEAD_DIM)

    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    if FP8:
        # div_rn: IEEE division, as torch's; `/` compiles to an approximate one on the GPU
        key = tl.math.div_rn(key.to(tl.float32), k_scale)
        value = tl.math.div_rn(value.to(tl.float32), v_scale)
        if SATURATE_AT > 0:  # e4m3fn: clamped here, not left to the conversion (kv_quant.saturation_bound)
            key = tl.minimum(tl.maximum(key, -SATURATE_AT), SATURATE_AT)
            value = tl.minimum(tl.maximum(value, -SATURATE_AT), SATURATE_AT)
    k_dest = k_cache_ptr + block_id * stride_k_block + block_offset * stride_k_offset
    v_dest = v_cache_ptr + block_id * stride_v_block + block_offset * stride_v_offset
    tl.store(
        k_dest + heads[:, None] * stride_k_head + dims[None, :],
        key.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dest + heads[:, None] * stride_v_head + dims[None, :],
        value.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value `[T, Hkv, D]` into the caches at `slot_mapping[T]` (int64; -1 skips), in place; fp8 caches
    store them divided by k_scale and v_scale."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _check_last_dim_contiguous(k_cache=k_cache, v_cache=v_cache)
    block_size = k_cache.shape[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_DIM=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        FP8=is_fp8(k_cache.dtype),
        SATURATE_AT=saturation_bound(k_cache.dtype),
    )


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Torch reference for `write_kv`: index the caches as `[num_blocks * block_size, Hkv, D]`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = quantize(key[keep], k_scale, k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = quantize(value[keep], v_scale, v_cache.dtype)
