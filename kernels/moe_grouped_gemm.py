"""Grouped GEMM for mixture-of-experts layers: every expert's matmul over its own tokens, in one launch.

Routing gives each token `top_k` (expert, weight) pairs; pair `p = token * top_k + j`. `moe_align` sorts the pairs
by expert and pads each expert's run to a multiple of `BLOCK_M` with a sentinel (`num_pairs`), so every `BLOCK_M`-row
tile of the sorted list belongs to one expert, named by `tile_experts[tile]`; experts with no pairs get no tile.
Everything is computed on the device with no host sync: the grid is sized for the worst case and tiles past the
padded total (`num_padded`, a one-element tensor) exit at once, so a decode step can be captured in a CUDA graph.

`grouped_gemm(a, w, align, rows_per_pair, out, pair_weights=None)` computes, for every real pair p,
    out[p] = a[p // rows_per_pair] @ w[expert(p)].T   (times pair_weights[p] when given)
with an fp32 accumulator: `rows_per_pair = top_k` reads the token's hidden state (gate/up projection),
`rows_per_pair = 1` reads the pair's own row (down projection).

`moe_experts(x, w13, w2, topk_ids, topk_weights)` is the whole expert block: gate/up grouped GEMM, SiLU(gate) * up
(not fused into the GEMM), down grouped GEMM scaled by the routing weight, and the sum over each token's pairs.
`moe_experts_ref` is the torch reference (a loop over experts, as transformers computes it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # rows per tile (the smallest tl.dot accepts); every expert's run is padded to a multiple of it


class MoeAlignment(NamedTuple):
    sorted_pair_ids: torch.Tensor  # int32 [max_tiles * BLOCK_M]: pair ids grouped by expert, padded with num_pairs
    tile_experts: torch.Tensor  # int32 [max_tiles]: the expert of each tile
    num_padded: torch.Tensor  # int32 [1]: rows in use (a multiple of BLOCK_M)
    num_pairs: int
    block_m: int


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> MoeAlignment:
    """Sort the (token, k) pairs of `topk_ids [T, top_k]` by expert into BLOCK_M-row tiles of one expert each."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read its max back to the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    first_pair = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - first_pair[sorted_experts]
    max_tiles = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    sorted_pair_ids = torch.full((max_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[padded_start[sorted_experts] + rank_in_expert] = order.to(torch.int32)
    tile_starts = torch.arange(max_tiles, device=device) * block_m
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts - 1)
    return MoeAlignment(
        sorted_pair_ids, tile_experts.to(torch.int32), padded_end[-1:].to(torch.int32), num_pairs, block_m
    )


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    tile_experts_ptr,
    num_padded_ptr,
    pair_weights_ptr,
    num_pairs,
    N,
    K,
    stride_a_row,
    stride_w_expert,
    stride_w_row,
    stride_out_row,
    ROWS_PER_PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if tile_m * BLOCK_M >= num_padded:
        return
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows)
    row_mask = pairs < num_pairs
    a_rows = (pairs // ROWS_PER_PAIR).to(tl.int64)
    expert = tl.load(tile_experts_ptr + tile_m).to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_base = w_ptr + expert * stride_w_expert + cols[None, :].to(tl.int64) * stride_w_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a_row + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(w_base + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE_DOT:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_WEIGHTS:
        scale = tl.load(pair_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_out_row + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _tile(size: int, largest: int) -> int:
    return max(16, min(largest, triton.next_power_of_2(size)))


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    align: MoeAlignment,
    rows_per_pair: int,
    out: torch.Tensor,
    pair_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[p] = a[p // rows_per_pair] @ w[expert(p)].T (* pair_weights[p]) for every pair; see the module docstring.

    a `[rows, K]` (last dim contiguous), w `[E, N, K]` (last dim contiguous), out `[num_pairs, N]`.
    """
    num_experts, n, k = w.shape
    if align.num_pairs == 0:
        return out
    if a.stride(-1) != 1:
        a = a.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    block_n, block_k = _tile(n, 64), _tile(k, 64)
    max_tiles = align.tile_experts.numel()
    weights = pair_weights.reshape(-1) if pair_weights is not None else align.sorted_pair_ids  # unused if no weights
    _grouped_gemm_kernel[(max_tiles, triton.cdiv(n, block_n))](
        a,
        w,
        out,
        align.sorted_pair_ids,
        align.tile_experts,
        align.num_padded,
        weights,
        align.num_pairs,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        ROWS_PER_PAIR=rows_per_pair,
        BLOCK_M=align.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_WEIGHTS=pair_weights is not None,
        IEEE_DOT=a.dtype == torch.float32,
    )
    return out


def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """sum_j weight[t, j] * down_e(SiLU(gate_e(x[t])) * up_e(x[t])) with e = topk_ids[t, j]; returns `[T, H]`.

    w13 `[E, 2I, H]` holds each expert's gate rows then its up rows; w2 `[E, H, I]`.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if num_tokens == 0:
        return torch.zeros(0, hidden, dtype=x.dtype, device=x.device)
    align = moe_align(topk_ids, num_experts)
    gate_up = grouped_gemm(x, w13, align, top_k, torch.empty(align.num_pairs, two_i, dtype=x.dtype, device=x.device))
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    down = torch.empty(align.num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(act, w2, align, 1, down, pair_weights=topk_weights)
    return down.view(num_tokens, top_k, -1).sum(dim=1)


def moe_experts_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Torch reference for `moe_experts` (computed in x's dtype; pass float64 tensors for an exact reference)."""
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out
