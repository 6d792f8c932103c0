"""Rotary position embedding applied to query and key heads, looked up by each token's position.

`cos_sin_cache[max_pos, rot_dim]` holds cos in its first half and sin in its second half
(`rot_dim <= head_dim`; dims past `rot_dim` pass through unchanged). NeoX style (HF Llama/Qwen
"rotate_half") pairs dim i with dim i + rot_dim/2; GPT-J style pairs dims 2i and 2i+1.
One program handles one token: all its query heads, then all its key heads; math is in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_token_heads(
    in_ptr,
    out_ptr,
    stride_in_head,
    stride_out_head,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    HALF_ROT: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NEOX_STYLE: tl.constexpr,
    COPY_TAIL: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    pairs = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (pairs[None, :] < HALF_ROT)
    if NEOX_STYLE:
        first_dims = pairs
        second_dims = pairs + HALF_ROT
    else:
        first_dims = pairs * 2
        second_dims = pairs * 2 + 1
    in_heads = in_ptr + heads[:, None] * stride_in_head
    out_heads = out_ptr + heads[:, None] * stride_out_head
    x1 = tl.load(in_heads + first_dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(in_heads + second_dims[None, :], mask=mask, other=0.0).to(tl.float32)
    out_type = out_ptr.dtype.element_ty
    tl.store(out_heads + first_dims[None, :], (x1 * cos - x2 * sin).to(out_type), mask=mask)
    tl.store(out_heads + second_dims[None, :], (x2 * cos + x1 * sin).to(out_type), mask=mask)
    if COPY_TAIL:
        dims = tl.arange(0, BLOCK_DIM)
        tail_mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] >= 2 * HALF_ROT) & (dims[None, :] < HEAD_DIM)
        tail = tl.load(in_heads + dims[None, :], mask=tail_mask)
        tl.store(out_heads + dims[None, :], tail, mask=tail_mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_q_out_token,
    stride_q_out_head,
    stride_k_out_token,
    stride_k_out_head,
    stride_cos_sin_pos,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    HALF_ROT: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NEOX_STYLE: tl.constexpr,
    COPY_TAIL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    cos_sin_row = cos_sin_ptr + position * stride_cos_sin_pos
    cos = tl.load(cos_sin_row + pairs, mask=pairs < HALF_ROT, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_row + HALF_ROT + pairs, mask=pairs < HALF_ROT, other=0.0).to(tl.float32)[None, :]
    _rotate_token_heads(
        q_ptr + token * stride_q_token,
        q_out_ptr + token * stride_q_out_token,
        stride_q_head,
        stride_q_out_head,
        cos,
        sin,
        NUM_Q_HEADS,
        BLOCK_Q_HEADS,
        HEAD_DIM,
        BLOCK_DIM,
        HALF_ROT,
        BLOCK_HALF,
        NEOX_STYLE,
        COPY_TAIL,
    )
    _rotate_token_heads(
        k_ptr + token * stride_k_token,
        k_out_ptr + token * stride_k_out_token,
        stride_k_head,
        stride_k_out_head,
        cos,
        sin,
        NUM_K_HEADS,
        BLOCK_K_HEADS,
        HEAD_DIM,
        BLOCK_DIM,
        HALF_ROT,
        BLOCK_HALF,
        NEOX_STYLE,
        COPY_TAIL,
    )


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    neox_style: bool = True,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q[T, Hq, D]` and `k[T, Hkv, D]` by `positions[T]`; returns new tensors unless `inplace`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rotary dim {rot_dim} must be even and <= head dim {head_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache must be contiguous in their last dimension")
    if inplace:
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half_rot = rot_dim // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_K_HEADS=triton.next_power_of_2(num_k_heads),
        HEAD_DIM=head_dim,
        BLOCK_DIM=triton.next_power_of_2(head_dim),
        HALF_ROT=half_rot,
        BLOCK_HALF=triton.next_power_of_2(half_rot),
        NEOX_STYLE=neox_style,
        COPY_TAIL=(not inplace) and rot_dim < head_dim,
    )
    return q_out, k_out


def rotary_cos_sin_cache(
    rot_dim: int, max_position: int, base: float = 10000.0, inv_freq: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 `[max_position, rot_dim]` table: cos then sin of position * inv_freq.

    `inv_freq` (`[rot_dim // 2]`) overrides the default `base ** (-2i / rot_dim)`, which is how
    scaled variants (linear, llama3, yarn...) computed elsewhere plug in.
    """
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox_style: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x32 = x.float()
    rotated, tail = x32[..., :rot_dim], x32[..., rot_dim:]
    if neox_style:
        x1, x2 = rotated.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, tail], dim=-1).to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference for `apply_rotary` (out of place)."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate_ref(q, cos, sin, neox_style), _rotate_ref(k, cos, sin, neox_style)
