"""Paged KV cache and attention: write this step's keys/values into their slots, attend through block tables.

Cache layout (shared with the Triton kernels in `kernels/`): per layer a K cache and a V cache, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token t of a step lives in flat slot
`slot_mapping[t] = block_id * block_size + offset`. The caches hold the model's dtype, or fp8 (`--kv-cache-dtype`)
holding key / k_scale and value / v_scale, per-tensor scales of the layer (`kernels/kv_quant.py`): every backend
quantizes on write and dequantizes what it reads; caches in the model's dtype ignore the scales.

Padding is read, then masked: decode chunks gather whole blocks (and block-table padding points at block 0), so
every slot of a block that appears in a block table, and all of block 0, must hold finite values, since a masked
NaN still poisons SDPA (0 * nan = nan). The model runner guarantees it by zeroing each block the first time it is
handed out; after that a slot holds zeros or stale but finite keys and values.

`AttentionMetadata` is built once per step by the model runner and shared by every layer; whatever can be
precomputed for the whole step (decode chunks and masks, per-sequence causal masks) is built there, not per layer.

Which implementation runs is decided in one place, `workers/backends.py`, which depends on the backends here and in
`workers/cpu_backend.py` and `workers/triton_backend.py`, never the other way round. A step's metadata is built for
one backend (`build_attention_metadata(..., backend)`) and carries it, so every layer of that step uses the same
one. The torch code below is the reference and the fallback: SDPA through the block tables. Kernels read only the
block-table entries their sequences' lengths cover, so they need none of the decode chunks and masks built here
(`builds_decode_chunks`); SDPA on prompts needs the per-sequence groups (`builds_prefill_groups`) of the sequences
with more query tokens than the backend's kernel takes (`max_kernel_query_len`: 1 for a decode kernel; the CPU
kernel also takes a speculative-decoding verification step's few tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.kernels.kv_quant import as_bytes, dequantize, quantize


# Decode attention gathers the K and V of a few sequences at a time, about this many bytes a layer, so the copy is
# still in the core's cache when SDPA reads it. Gathering the whole batch at once (15 MB a layer for 32 sequences of
# 320 tokens of the default model) sends the copy to memory and back, and made decode attention 2-3x slower.
DECODE_GATHER_BYTES = 2 * 2**20


@dataclass
class DecodeChunk:
    """Consecutive decode sequences [start, end) of a `DecodeGroup`, attended in one batched SDPA call."""

    start: int
    end: int
    block_tables: torch.Tensor  # [end - start, num_blocks] int64: as many columns as the chunk's longest sequence needs
    num_keys: int  # the chunk's longest sequence
    key_mask: torch.Tensor | None  # [end - start, 1, 1, num_keys] bool, True where the key is in the sequence;
    # None when every sequence of the chunk has num_keys keys
    seq_lens: torch.Tensor | None = None  # [end - start] int64: each sequence's keys (for sliding windows)
    # sliding window -> (block ids [n, cols], key mask [n, 1, 1, cols * block_size]): built by the first layer
    # with that window, reused by the others
    windowed: dict = field(default_factory=dict)


@dataclass
class DecodeGroup:
    """The sequences of a step that have exactly one query token, attended in chunks of a few sequences."""

    token_indices: torch.Tensor | None  # [Bd] int64 rows of the flat batch; None when the whole batch is decode
    chunks: list[DecodeChunk]


@dataclass
class PrefillSequence:
    """One sequence with more query tokens than the backend's kernel takes (a prompt, a prompt chunk, or a resumed
    request; with the torch backend, any sequence of several query tokens)."""

    query_start: int
    query_end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    causal_mask: torch.Tensor | None  # [q_len, seq_len] bool; None when q_len == seq_len (plain causal)
    # sliding window -> (first block read, [q_len, keys read] mask): built by the first layer with that window
    windowed: dict = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flat batch of T tokens from B sequences."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of every new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step (computed + scheduled)
    is_decode_only: bool
    max_query_len: int
    max_seq_len: int
    block_size: int
    decode: DecodeGroup | None  # the single-token sequences, batched
    prefills: list[PrefillSequence]  # the sequences of more than backend.max_kernel_query_len tokens, one SDPA each
    backend: AttentionBackend  # the implementation this metadata was built for

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def _decode_chunk_bounds(padded_lens: np.ndarray, max_tokens: int | None) -> list[tuple[int, int]]:
    """Split consecutive sequences into [start, end) runs whose count times longest padded length fits `max_tokens`.

    A sequence longer than the budget gets a chunk of its own.
    """
    if max_tokens is None:
        return [(0, len(padded_lens))]
    bounds, start, longest = [], 0, 0
    for i, length in enumerate(padded_lens.tolist()):
        longest = max(longest, length)
        if i > start and (i + 1 - start) * longest > max_tokens:
            bounds.append((start, i))
            start, longest = i, length
    bounds.append((start, len(padded_lens)))
    return bounds


def token_positions(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Positions `[T]` of a flat batch: sequence b's query i sits at seq_lens[b] - query_lens[b] + i."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    first_token = np.cumsum(query_lens) - query_lens
    return np.arange(int(query_lens.sum())) - first_token[seq_of_token] + (seq_lens - query_lens)[seq_of_token]


def build_attention_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    device: torch.device,
    backend: AttentionBackend,
    decode_chunk_tokens: int | None = None,
) -> AttentionMetadata:
    """Build a step's metadata from host arrays: query_lens[B], seq_lens[B] and block_tables[B, max_blocks].

    `decode_chunk_tokens` bounds the (padded) keys of one decode chunk; None puts every decode sequence in one chunk.
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    block_tables = np.asarray(block_tables, dtype=np.int64)
    num_seqs = len(query_lens)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])

    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = token_positions(query_lens, seq_lens)
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

    blocks_needed = -(-seq_lens // block_size)
    is_decode = query_lens == 1
    is_decode_only = bool(is_decode.all())
    decode = None
    if backend.builds_decode_chunks and is_decode.any():
        decode_seqs = np.flatnonzero(is_decode)
        chunks = []
        for start, end in _decode_chunk_bounds(blocks_needed[decode_seqs] * block_size, decode_chunk_tokens):
            chunk_seqs = decode_seqs[start:end]
            chunk_lens = seq_lens[chunk_seqs]
            num_keys = int(chunk_lens.max())
            key_mask = None
            if (chunk_lens != num_keys).any():
                key_mask = to_device((np.arange(num_keys)[None, :] < chunk_lens[:, None])[:, None, None, :], torch.bool)
            num_blocks = int(blocks_needed[chunk_seqs].max())
            chunks.append(DecodeChunk(start, end, to_device(block_tables[chunk_seqs, :num_blocks], torch.int64),
                                      num_keys, key_mask, to_device(chunk_lens, torch.int64)))
        decode = DecodeGroup(
            token_indices=None if is_decode_only else to_device(query_start_loc[decode_seqs], torch.int64),
            chunks=chunks,
        )

    prefills = []
    for seq in np.flatnonzero(query_lens > backend.max_kernel_query_len) if backend.builds_prefill_groups else ():
        q_len, seq_len = int(query_lens[seq]), int(seq_lens[seq])
        causal_mask = None
        if q_len != seq_len:
            query_positions = np.arange(seq_len - q_len, seq_len)
            causal_mask = to_device(np.arange(seq_len)[None, :] <= query_positions[:, None], torch.bool)
        prefills.append(
            PrefillSequence(
                query_start=int(query_start_loc[seq]),
                query_end=int(query_start_loc[seq + 1]),
                seq_len=seq_len,
                block_ids=to_device(block_tables[seq, : blocks_needed[seq]], torch.int64),
                causal_mask=causal_mask,
            )
        )

    return AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.int64),
        block_tables=to_device(block_tables, torch.int32),
        query_start_loc=to_device(query_start_loc, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        is_decode_only=is_decode_only,
        max_query_len=int(query_lens.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        block_size=block_size,
        decode=decode,
        prefills=prefills,
        backend=backend,
    )



# ---------------------------------------------------------------- the cache tensors



def kv_block_bytes(model, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across every layer of `model` (its `num_layers`, `num_kv_heads`, `head_dim`), K and V."""
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * dtype.itemsize


def allocate_kv_caches(model, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer of `model` a K and a V cache of `model.kv_cache_shape`, zero-filled: writing every page now makes
    the whole pool resident at start (an overcommitted host fails here, not hours later as blocks are first used)."""
    shape = model.kv_cache_shape(num_blocks, block_size)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)]


def zero_kv_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: torch.Tensor) -> None:
    """Zero the given blocks of every layer's K and V cache, as bytes: torch has no CPU index_fill_ for fp8 (and
    byte 0 is +0.0 in every cache dtype)."""
    for k_cache, v_cache in kv_caches:
        as_bytes(k_cache).index_fill_(0, block_ids, 0)
        as_bytes(v_cache).index_fill_(0, block_ids, 0)

# ---------------------------------------------------------------- torch implementation (CPU, and correct anywhere)


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value `[T, Hkv, D]` into the caches at their flat slots, in place (fp8: divided by their scales)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    # as bytes: torch has no CPU index_copy_ for fp8
    for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        rows = as_bytes(cache).view(num_blocks * block_size, num_kv_heads, head_dim)
        rows.index_copy_(0, slot_mapping, as_bytes(quantize(x, scale, cache.dtype)))


def _gather_sequence(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's cached keys or values as `[Hkv, seq_len, D]`, read through its block ids."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    return gathered.transpose(0, 1)


def sliding_window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """`[q, k]` bool: key k is visible to query q under causal attention with a sliding window of `window` keys.

    As transformers (`masking_utils.sliding_window_overlay` on the causal mask): q - window < k <= q, so a query sees
    itself and the window - 1 keys before it.
    """
    diff = query_positions[:, None] - key_positions[None, :]
    return (diff >= 0) & (diff < window)


def _decode_window(chunk: DecodeChunk, window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids `[n, cols]`, key mask `[n, 1, 1, cols * block_size]`) of a decode chunk's sliding-window keys.

    Each sequence reads only the blocks its window touches (from the block of its first visible key), so blocks that
    slid out of the window (freed by the scheduler, possibly someone else's by now) are never read. Columns past a
    sequence's last block repeat that block and are masked.
    """
    cached = chunk.windowed.get(window)
    if cached is not None:
        return cached
    lens = chunk.seq_lens
    first_key = (lens - window).clamp(min=0)
    first_block = first_key // block_size
    num_cols = min(chunk.block_tables.shape[1], (window - 1 + block_size - 1) // block_size + 1)
    cols = first_block[:, None] + torch.arange(num_cols, device=lens.device)
    block_ids = chunk.block_tables.gather(1, torch.minimum(cols, ((lens - 1) // block_size)[:, None]))
    positions = first_block[:, None] * block_size + torch.arange(num_cols * block_size, device=lens.device)
    mask = ((positions >= first_key[:, None]) & (positions < lens[:, None]))[:, None, None, :]
    chunk.windowed[window] = block_ids, mask
    return block_ids, mask


def _attend_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Single-token queries `[Bd, Hq, D]`: per chunk of sequences, gather their blocks (dequantized from an fp8
    cache) and run one masked SDPA."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    # Grouped-query attention without repeating K/V: the G query heads sharing a KV head act as G query rows.
    grouped_query = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(grouped_query)
    for chunk in group.chunks:
        shape = (chunk.end - chunk.start, -1, num_kv_heads, head_dim)
        if sliding_window is not None and chunk.num_keys > sliding_window:
            block_ids, key_mask = _decode_window(chunk, sliding_window, block_size)
            num_keys = key_mask.shape[-1]
        else:
            block_ids, key_mask, num_keys = chunk.block_tables, chunk.key_mask, chunk.num_keys
        flat_blocks = block_ids.reshape(-1)
        keys = k_cache.index_select(0, flat_blocks).view(shape)[:, :num_keys].transpose(1, 2)
        values = v_cache.index_select(0, flat_blocks).view(shape)[:, :num_keys].transpose(1, 2)
        keys, values = dequantize(keys, k_scale, query.dtype), dequantize(values, v_scale, query.dtype)
        out[chunk.start : chunk.end] = F.scaled_dot_product_attention(
            grouped_query[chunk.start : chunk.end], keys, values, attn_mask=key_mask, scale=scale
        )
    return out.view(num_seqs, num_heads, head_dim)


def attend_prefills_sdpa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: list[PrefillSequence],
    scale: float,
    output: torch.Tensor,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Into `output`'s rows of each multi-token sequence, its causal attention: one SDPA call per sequence.

    With a sliding window, keys are read from the block of the first query's first visible key on. An fp8 cache's
    keys and values are dequantized after the gather.
    """
    block_size = k_cache.shape[1]
    for seq in prefills:
        # 4-d [1, heads, len, D]: torch's CPU SDPA takes a far slower path for 3-d GQA inputs with a mask.
        seq_query = query[seq.query_start : seq.query_end].transpose(0, 1)[None]
        block_ids, num_keys, mask = seq.block_ids, seq.seq_len, seq.causal_mask
        if sliding_window is not None and seq.seq_len > sliding_window:
            windowed = seq.windowed.get(sliding_window)
            if windowed is None:
                first_query = seq.seq_len - (seq.query_end - seq.query_start)
                first_block = max(0, first_query - sliding_window + 1) // block_size
                positions = torch.arange(first_block * block_size, seq.seq_len, device=query.device)
                windowed = first_block, sliding_window_mask(positions[first_query - first_block * block_size :],
                                                            positions, sliding_window)
                seq.windowed[sliding_window] = windowed
            first_block, mask = windowed
            block_ids, num_keys = block_ids[first_block:], seq.seq_len - first_block * block_size
        keys = dequantize(_gather_sequence(k_cache, block_ids, num_keys)[None], k_scale, query.dtype)
        values = dequantize(_gather_sequence(v_cache, block_ids, num_keys)[None], v_scale, query.dtype)
        seq_out = F.scaled_dot_product_attention(
            seq_query,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        output[seq.query_start : seq.query_end] = seq_out[0].transpose(0, 1)


def paged_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of query `[T, Hq, D]` over each sequence's cached keys/values; returns `[T, Hq, D]`.

    The caches must already hold this step's keys and values. With `sliding_window` a query at position p sees only
    keys p - window < k <= p. k_scale and v_scale: what an fp8 cache's keys and values are multiplied by when read.
    """
    decode = metadata.decode
    kv_scales = dict(k_scale=k_scale, v_scale=v_scale)
    if metadata.is_decode_only and decode is not None:
        return _attend_decode(query, k_cache, v_cache, decode, scale, sliding_window, **kv_scales)

    output = torch.empty_like(query)
    if decode is not None:
        decode_query = query.index_select(0, decode.token_indices)
        decoded = _attend_decode(decode_query, k_cache, v_cache, decode, scale, sliding_window, **kv_scales)
        output.index_copy_(0, decode.token_indices, decoded)
    attend_prefills_sdpa(query, k_cache, v_cache, metadata.prefills, scale, output, sliding_window, **kv_scales)
    return output


# ---------------------------------------------------------------- the backend interface


class AttentionBackend(Protocol):
    # whether `build_attention_metadata` must prepare `decode` (chunks and masks for batched decode SDPA) and
    # `prefills` (a group for SDPA per sequence of more than `max_kernel_query_len` query tokens: the sequences
    # `attend` leaves to SDPA). Both methods take the layer's k_scale and v_scale, which an fp8 cache stores keys and
    # values divided by (and a cache in the model's dtype ignores).
    builds_decode_chunks: bool
    builds_prefill_groups: bool
    max_kernel_query_len: int

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    """Pure torch: gathers through the block tables and calls SDPA."""

    builds_decode_chunks = True
    builds_prefill_groups = True
    max_kernel_query_len = 1  # single-token sequences go through the batched decode SDPA, the others one by one
    write_kv = staticmethod(write_kv_torch)
    attend = staticmethod(paged_attention_torch)


def write_kv_and_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One layer's paged attention: store this step's key/value `[T, Hkv, D]`, then attend; returns `[T, Hq, D]`.

    `sliding_window` (per layer; None for full attention): a query at position p attends to keys p - window < k <= p,
    as transformers' sliding-window mask (Mistral, Qwen2 `use_sliding_window`, Gemma 3's local layers).
    `k_scale`, `v_scale` (per layer): an fp8 cache stores key / k_scale and value / v_scale.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of keys, got {sliding_window}")
    k_cache, v_cache = kv_cache
    metadata.backend.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
    return metadata.backend.attend(query, k_cache, v_cache, metadata, scale, sliding_window=sliding_window,
                                   k_scale=k_scale, v_scale=v_scale)
