"""Split-KV (flash-decoding) decode attention over the paged KV cache, with its float64 torch reference.

The decode kernel of `kernels/paged_attention.py` runs one program per (sequence, kv head): at batch 1 with 8 kv
heads that is 8 programs on a 132-SM GPU, each walking the whole context alone. Here the context is split into
`num_splits` partitions, one program each (grid: sequences x kv heads x splits). A program folds its partition into
an online softmax and writes a partial output (normalized by its own sum) and its log-sum-exp (in log2 units);
a second kernel combines a head's partials with the log-sum-exp rule:

    out = sum_s 2^(lse_s - m) * out_s / sum_s 2^(lse_s - m),   m = max_s lse_s

With one split the first kernel writes the final output itself and the reduce is not launched.

Partitions are cut in the kernel from each sequence's own length (its visible keys in tiles of TILE_KEYS, the tiles
shared out evenly), so the split count only sets the grid: it is chosen on the host from shapes alone
(`choose_num_splits`), needs no device-to-host sync, and a CUDA graph captured with one split count stays correct
for any context. A partition that gets no tile (a context shorter than the splits) writes lse = -inf and weighs 0.

Query-head groups. A program's rows are the query heads sharing its kv head (GQA), padded to tl.dot's 16-row
minimum: padding costs tensor-core cycles only, never memory traffic (each K/V tile is still read once per kv
head). A broadcast multiply-and-sum on the CUDA cores for groups up to 4 (no padding) was tried and removed: on an
H100 it moved 440-470 GB/s where the tl.dot tile moved 1,900-2,700 GB/s at the same sizes (docs/gpu/, 2026-11-27).

Everything else is the old kernel's: paged K/V through block tables (any block size), sliding windows (the key loop
starts at the window), fp8 caches with per-tensor k/v scales (k_scale folded into the softmax scale, v_scale into
the output), fp32/fp16/bf16 queries.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_quant import dequantize
from tokenmill.kernels.paged_attention import (
    _LOG2E,
    DECODE_TILE_KEYS,
    _attend_kv_tile,
    _check_shapes,
    _gather_sequence_kv,
    _kv_scale,
    _padded_dims,
)

MIN_DOT_ROWS = 16  # the smallest tile side tl.dot accepts
DECODE_NUM_WARPS = 4
MIN_KEYS_PER_SPLIT = 256  # below this a partition's fixed cost (query load, partial write, reduce) dominates
MAX_SPLITS = 64


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    num_sms: int,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
    max_splits: int = MAX_SPLITS,
) -> int:
    """How many partitions to cut each sequence's context into, from host-known shapes only.

    One split when sequences x kv heads already fill every SM once; else enough splits for about two programs per
    SM (so one program's loads overlap another's math), but never partitions under `min_keys_per_split` keys of
    the longest context, nor more than `max_splits`.
    """
    programs = num_seqs * num_kv_heads
    if programs == 0 or max_context <= 0 or programs >= num_sms:
        return 1
    for_two_waves = math.ceil(2 * num_sms / programs)
    for_context = math.ceil(max_context / min_keys_per_split)
    return max(1, min(for_two_waves, for_context, max_splits))


def decode_rows(group: int) -> int:
    """A program's query rows: the group padded to a power of two, at least tl.dot's smallest tile."""
    return max(MIN_DOT_ROWS, triton.next_power_of_2(group))


@triton.jit
def _split_kv_partial_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    v_scale,
    window,
    num_q_heads,
    stride_q_token,
    stride_q_head,
    stride_k_block,
    stride_k_offset,
    stride_k_head,
    stride_v_block,
    stride_v_offset,
    stride_v_head,
    stride_table_seq,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_KEYS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The one query sits at seq_len - 1: with a window it sees keys [seq_len - window, seq_len).
    first_key = 0
    if SLIDING:
        first_key = tl.maximum(seq_len - window, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first_key, TILE_KEYS), NUM_SPLITS)
    split_start = first_key + split * tiles_per_split * TILE_KEYS
    split_end = tl.minimum(split_start + tiles_per_split * TILE_KEYS, seq_len)

    rows = tl.arange(0, BLOCK_GROUP)
    q_heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_q_token + q_heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    q = q.to(tl.float32) * scale_log2  # the softmax scale, in log2 units for exp2, folded into q once
    q = q.to(query_ptr.dtype.element_ty)

    running_max = tl.full([BLOCK_GROUP], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_GROUP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for tile_start in range(split_start, split_end, TILE_KEYS):
        running_max, running_sum, acc = _attend_kv_tile(
            q, running_max, running_sum, acc, k_cache_ptr, v_cache_ptr, table_row, tile_start, split_end,
            rows, kv_head, stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset,
            stride_v_head, dims, dim_mask, window, False, False, BLOCK_SIZE, TILE_KEYS, IEEE_DOT,
        )  # fmt: skip

    # An empty partition (or sequence) leaves running_sum at 0: its output is 0 rather than NaN.
    out = acc * (v_scale / tl.where(running_sum > 0, running_sum, 1.0))[:, None]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * stride_out_token + q_heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # partials are [seq, q head, split, HEAD_DIM] fp32, lse [seq, q head, split]
        slots = (seq.to(tl.int64) * num_q_heads + q_heads) * NUM_SPLITS + split
        tl.store(partial_out_ptr + slots[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
        safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
        lse = tl.where(running_sum > 0, running_max + tl.log2(safe_sum), float("-inf"))
        tl.store(partial_lse_ptr + slots, lse, mask=row_mask)


@triton.jit
def _split_kv_reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_q_heads,
    stride_out_token,
    stride_out_head,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """One (sequence, query head): its partitions' outputs weighted by 2^(lse - max lse), over their total."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims < HEAD_DIM
    slots = (seq.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + splits
    lse = tl.load(partial_lse_ptr + slots, mask=split_mask, other=float("-inf"))
    max_lse = tl.max(lse, axis=0)
    # every partition empty (a zero-length sequence): weigh them 0 rather than exp2(-inf - -inf) = NaN
    weights = tl.exp2(lse - tl.where(max_lse == float("-inf"), 0.0, max_lse))
    total = tl.sum(weights, axis=0)
    partials = tl.load(
        partial_out_ptr + slots[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.sum(partials * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def split_kv_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query token per sequence, `[B, Hq, D]`, attending to its `seq_lens[b]` cached tokens (the last
    `sliding_window` of them with a window), each context cut into `num_splits` partitions. An fp8 cache holds
    keys / k_scale and values / v_scale. Returns `[B, Hq, D]` in the query's dtype."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    group, block_size = _check_shapes(query, k_cache, v_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs, num_q_heads, head_dim = query.shape
    if num_seqs == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    partial_out = out  # unused with one split (the kernel writes `out` itself)
    partial_lse = out
    if num_splits > 1:
        partial_out = torch.empty(
            (num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=query.device)
    _split_kv_partial_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, partial_out, partial_lse,
        scale * _LOG2E * _kv_scale(k_cache, k_scale), _kv_scale(v_cache, v_scale), sliding_window or 0, num_q_heads,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_GROUP=decode_rows(group), HEAD_DIM=head_dim, BLOCK_DIM=_padded_dims(head_dim),
        BLOCK_SIZE=block_size, TILE_KEYS=DECODE_TILE_KEYS, NUM_SPLITS=num_splits,
        IEEE_DOT=query.dtype == torch.float32, SLIDING=sliding_window is not None, num_warps=DECODE_NUM_WARPS,
    )  # fmt: skip
    if num_splits > 1:
        _split_kv_reduce_kernel[(num_seqs, num_q_heads)](
            partial_out, partial_lse, out, num_q_heads, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_SPLITS=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            BLOCK_DIM=_padded_dims(head_dim),
        )  # fmt: skip
    return out


def split_kv_decode_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Float64 reference of `split_kv_decode` (any split count gives the same math): plain softmax attention of
    each sequence's query over its gathered, dequantized keys, the window applied by slicing. Returns float64."""
    num_seqs, num_q_heads, head_dim = query.shape
    out = torch.zeros((num_seqs, num_q_heads, head_dim), dtype=torch.float64, device=query.device)
    for seq, seq_len in enumerate(seq_lens.tolist()):
        first_key = max(seq_len - sliding_window, 0) if sliding_window is not None else 0
        if seq_len == 0:
            continue
        key = dequantize(_gather_sequence_kv(k_cache, block_tables[seq], seq_len), k_scale, torch.float64)[first_key:]
        value = dequantize(_gather_sequence_kv(v_cache, block_tables[seq], seq_len), v_scale, torch.float64)
        value = value[first_key:]
        group = num_q_heads // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", query[seq].double(), key) * scale
        out[seq] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), value)
    return out
