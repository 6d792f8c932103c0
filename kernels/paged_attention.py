"""Attention over the paged KV cache: a decode kernel and a varlen (chunked) prefill kernel.

Both read K/V only through each sequence's block table from caches shaped
`[num_blocks, block_size, num_kv_heads, head_dim]`. A program walks its sequence in tiles of
TILE_KEYS keys (each key's physical block looked up in the table, so a tile may span blocks and any
block size works) with an online softmax: running max, running sum and an fp32 accumulator. GQA is
handled by packing all query heads that share a kv head into the rows of one tile, so each K/V tile
is read once per kv head rather than once per query head. `tl.dot` needs tiles of at least 16 on
every side, so rows are padded up to 16 and the head dim up to a power of two, with masks.

Sliding window (`sliding_window`, per layer, as transformers): a query at position p sees keys
p - window < k <= p. Both kernels start their key loop at the first key any of their rows can see,
so blocks that slid out of the window (which the scheduler may have freed) are never read.

FP8 caches (`kernels/kv_quant.py`): a K or V tile is loaded as fp8 and converted to the query's dtype, in which the
dots run; the per-tensor scales are applied outside the loop, k_scale folded into the softmax scale (q . (k_scale k) =
(k_scale q) . k) and v_scale into the output (sum p (v_scale v) = v_scale sum p v).

Decode: one program per (sequence, kv head); rows are the group's query heads.
Prefill: one program per (query tile, kv head); rows are (query token, head in group) pairs, and a
program finds its sequence by binary search over `query_start_loc`, so the launch grid depends only
on shapes known on the host (no device-to-host sync).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_quant import dequantize, is_fp8

_LOG2E = 1.4426950408889634
_MIN_DOT_SIZE = 16  # the smallest tile side tl.dot accepts
DECODE_TILE_KEYS = 32
PREFILL_TILE_KEYS = 32


@triton.jit
def _attend_kv_tile(
    q,
    running_max,
    running_sum,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table_row,
    tile_start,
    num_keys,
    query_positions,
    kv_head,
    stride_k_block,
    stride_k_offset,
    stride_k_head,
    stride_v_block,
    stride_v_offset,
    stride_v_head,
    dims,
    dim_mask,
    window,
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_KEYS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """Fold keys [tile_start, tile_start + TILE_KEYS) (< num_keys) into the online softmax state.

    Each key's physical block comes from the block table, so a tile may span several blocks. With SLIDING (and
    CAUSAL) a row sees only keys within `window` of its query position; a row may then see nothing in a tile, which
    the softmax state survives (its max stays -inf, its sum and accumulator 0).
    """
    key_positions = tile_start + tl.arange(0, TILE_KEYS)
    key_mask = key_positions < num_keys
    physical_blocks = tl.load(table_row + key_positions // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    offsets_in_block = key_positions % BLOCK_SIZE
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(
        k_cache_ptr
        + physical_blocks[:, None] * stride_k_block
        + offsets_in_block[:, None] * stride_k_offset
        + kv_head * stride_k_head
        + dims[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(q.dtype)  # fp8 caches: dequantized here (their scale is applied outside the loop); else a no-op
    if IEEE_DOT:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    if CAUSAL:
        # Without a window position 0 is visible to every row, so no row is all -inf after the first tile.
        visible = key_mask[None, :] & (key_positions[None, :] <= query_positions[:, None])
        if SLIDING:
            visible = visible & (key_positions[None, :] > query_positions[:, None] - window)
    else:
        visible = key_mask[None, :]
    scores = tl.where(visible, scores, float("-inf"))

    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    if SLIDING:
        # a row with nothing visible yet has max -inf: subtract 0 instead, so exp2 gives 0 rather than NaN
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(running_max - safe_max)
    else:
        probs = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(running_max - new_max)
    running_sum = running_sum * correction + tl.sum(probs, axis=1)
    v = tl.load(
        v_cache_ptr
        + physical_blocks[:, None] * stride_v_block
        + offsets_in_block[:, None] * stride_v_offset
        + kv_head * stride_v_head
        + dims[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(q.dtype)
    if IEEE_DOT:
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v)
    return new_max, running_sum, acc


@triton.jit
def _decode_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    v_scale,
    window,
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
    IEEE_DOT: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_GROUP)
    q_heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims < HEAD_DIM
    # The softmax scale (in log2 units, for exp2) is folded into q once instead of into every score.
    q = tl.load(
        query_ptr + seq * stride_q_token + q_heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    q = (q.to(tl.float32) * scale_log2).to(query_ptr.dtype.element_ty)

    running_max = tl.full([BLOCK_GROUP], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_GROUP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    # The one query sits at seq_len - 1: with a window it sees keys [seq_len - window, seq_len), so start there.
    first_key = 0
    if SLIDING:
        first_key = tl.maximum(seq_len - window, 0)
    for tile_start in range(first_key, seq_len, TILE_KEYS):
        running_max, running_sum, acc = _attend_kv_tile(
            q, running_max, running_sum, acc, k_cache_ptr, v_cache_ptr, table_row, tile_start, seq_len,
            rows, kv_head, stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset,
            stride_v_head, dims, dim_mask, window, False, False, BLOCK_SIZE, TILE_KEYS, IEEE_DOT,
        )  # fmt: skip

    # seq_len == 0 leaves running_sum at 0: write zeros rather than NaN.
    out = acc * (v_scale / tl.where(running_sum > 0, running_sum, 1.0))[:, None]
    tl.store(
        out_ptr + seq * stride_out_token + q_heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, TOKENS_PER_TILE: tl.constexpr):
    """The sequence whose query tiles include global tile `tile`.

    Sequence b's tiles start at `query_start_loc[b] // TOKENS_PER_TILE + b`, an upper bound on the
    tiles used by sequences before it, which is what makes the host-side grid size safe.
    """
    low: tl.int32 = 0
    high: tl.int32 = num_seqs
    while low < high:
        mid = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // TOKENS_PER_TILE + mid
        if first_tile <= tile:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    v_scale,
    window,
    num_seqs,
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
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_KEYS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    SLIDING: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, TOKENS_PER_TILE)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    tile_in_seq = tile - (query_start // TOKENS_PER_TILE + seq)
    if tile_in_seq * TOKENS_PER_TILE >= query_len:
        return

    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens cached before this step's queries

    # Row r holds query token (tile start + r // GROUP) for query head (kv_head * GROUP + r % GROUP).
    rows = tl.arange(0, BLOCK_ROWS)
    token_in_seq = tile_in_seq * TOKENS_PER_TILE + rows // GROUP
    q_heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < TOKENS_PER_TILE * GROUP) & (token_in_seq < query_len)
    query_positions = context_len + token_in_seq
    tokens = (query_start + token_in_seq).to(tl.int64)
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims < HEAD_DIM

    q = tl.load(
        query_ptr + tokens[:, None] * stride_q_token + q_heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    q = (q.to(tl.float32) * scale_log2).to(query_ptr.dtype.element_ty)

    running_max = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq

    # Keys past the tile's last query position are masked for every row, so stop there.
    num_keys = context_len + tl.minimum((tile_in_seq + 1) * TOKENS_PER_TILE, query_len)
    # With a window, keys before the tile's first query position - window + 1 are masked for every row.
    first_key = 0
    if SLIDING:
        first_key = tl.maximum(context_len + tile_in_seq * TOKENS_PER_TILE - window + 1, 0)
    for tile_start in range(first_key, num_keys, TILE_KEYS):
        running_max, running_sum, acc = _attend_kv_tile(
            q, running_max, running_sum, acc, k_cache_ptr, v_cache_ptr, table_row, tile_start, num_keys,
            query_positions, kv_head, stride_k_block, stride_k_offset, stride_k_head, stride_v_block,
            stride_v_offset, stride_v_head, dims, dim_mask, window, True, SLIDING, BLOCK_SIZE, TILE_KEYS, IEEE_DOT,
        )  # fmt: skip

    out = acc * (v_scale / tl.where(running_sum > 0, running_sum, 1.0))[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_out_token + q_heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def _check_shapes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """Return (group size, block size) after checking the caches match the query."""
    num_q_heads, head_dim = query.shape[1:]
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if cache_head_dim != head_dim:
        raise ValueError(f"query head dim {head_dim} != cache head dim {cache_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous in the head dim")
    return num_q_heads // num_kv_heads, block_size


def _kv_scale(cache: torch.Tensor, scale: float) -> float:
    """The scale a cache's values are multiplied by when read: fp8 caches hold value / scale, others the value."""
    return float(scale) if is_fp8(cache.dtype) else 1.0


def _padded_dims(head_dim: int) -> int:
    return max(_MIN_DOT_SIZE, triton.next_power_of_2(head_dim))


def paged_attention_decode(
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
    """One query token per sequence, `[B, Hq, D]`, attending to its `seq_lens[b]` cached tokens (the last
    `sliding_window` of them with a window). An fp8 cache holds keys / k_scale and values / v_scale."""
    group, block_size = _check_shapes(query, k_cache, v_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs, _, head_dim = query.shape
    if num_seqs == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    num_kv_heads = k_cache.shape[2]
    _decode_kernel[(num_seqs, num_kv_heads)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        scale * _LOG2E * _kv_scale(k_cache, k_scale),
        _kv_scale(v_cache, v_scale),
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_GROUP=max(_MIN_DOT_SIZE, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_DIM=_padded_dims(head_dim),
        BLOCK_SIZE=block_size,
        TILE_KEYS=DECODE_TILE_KEYS,
        IEEE_DOT=query.dtype == torch.float32,
        SLIDING=sliding_window is not None,
    )
    return out


def prefill_tile_shape(group: int, rows_per_tile: int = 64) -> tuple[int, int]:
    """(query tokens per tile, rows per tile) for a GQA group size: rows = tokens * group, padded."""
    block_rows = max(rows_per_tile, triton.next_power_of_2(group))
    return block_rows // group, block_rows


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Packed varlen queries `[T, Hq, D]` attending causally to cache positions <= their own (and, with a
    `sliding_window`, > their own - window).

    Sequence b's queries are rows `query_start_loc[b]:query_start_loc[b+1]` and sit at the last
    q_len positions of its `seq_lens[b]` tokens, whose K/V (including this step's) are already in
    the cache. Covers full prefill, chunked prefill, prefix-cache hits and (q_len 1) decode. An fp8 cache holds
    keys / k_scale and values / v_scale.
    """
    group, block_size = _check_shapes(query, k_cache, v_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, _, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    num_kv_heads = k_cache.shape[2]
    tokens_per_tile, block_rows = prefill_tile_shape(group)
    # Each sequence's tiles start at query_start // tokens_per_tile + b, so this bounds the count.
    num_tiles = num_tokens // tokens_per_tile + num_seqs
    _prefill_kernel[(num_tiles, num_kv_heads)](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E * _kv_scale(k_cache, k_scale),
        _kv_scale(v_cache, v_scale),
        sliding_window or 0,
        num_seqs,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        TOKENS_PER_TILE=tokens_per_tile,
        BLOCK_ROWS=block_rows,
        HEAD_DIM=head_dim,
        BLOCK_DIM=_padded_dims(head_dim),
        BLOCK_SIZE=block_size,
        TILE_KEYS=PREFILL_TILE_KEYS,
        IEEE_DOT=query.dtype == torch.float32,
        SLIDING=sliding_window is not None,
    )
    return out


def _gather_sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """`[seq_len, Hkv, D]` K or V of one sequence, gathered through its block table."""
    block_size = cache.shape[1]
    num_blocks = math.ceil(seq_len / block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def _attend_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain softmax attention in fp32 of `[q, Hq, D]` over `[n, Hkv, D]` with a causal (sliding-window) mask."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale
    key_positions = torch.arange(key.shape[0], device=query.device)
    scores = scores.masked_fill(key_positions[None, None, :] > query_positions[None, :, None], float("-inf"))
    if sliding_window is not None:
        hidden = key_positions[None, None, :] <= query_positions[None, :, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), value)


def paged_attention_decode_ref(
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
    """Torch reference for `paged_attention_decode`, one sequence at a time (gathering all its keys, then masking)."""
    out = torch.zeros_like(query)
    for seq, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        key = dequantize(_gather_sequence_kv(k_cache, block_tables[seq], seq_len), k_scale, torch.float32)
        value = dequantize(_gather_sequence_kv(v_cache, block_tables[seq], seq_len), v_scale, torch.float32)
        position = torch.tensor([seq_len - 1], device=query.device)
        out[seq] = _attend_ref(query[seq : seq + 1], key, value, position, scale, sliding_window)[0].to(query.dtype)
    return out


def paged_attention_prefill_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Torch reference for `paged_attention_prefill`, one sequence at a time (gathering all its keys, then masking)."""
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        key = dequantize(_gather_sequence_kv(k_cache, block_tables[seq], seq_len), k_scale, torch.float32)
        value = dequantize(_gather_sequence_kv(v_cache, block_tables[seq], seq_len), v_scale, torch.float32)
        positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        out[start:end] = _attend_ref(query[start:end], key, value, positions, scale, sliding_window).to(query.dtype)
    return out
