"""Paged KV cache and attention: write this step's keys/values into their slots, attend through block tables.

Cache layout (shared with the Triton kernels in `kernels/`): per layer a K cache and a V cache, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token t of a step lives in flat slot
`slot_mapping[t] = block_id * block_size + offset`. The caches hold the model's dtype, or fp8 (`--kv-cache-dtype`)
holding key / k_scale and value / v_scale, per-tensor scales of the layer (`kernels/kv_quant.py`): every backend
quantizes on write and dequantizes what it reads; caches in the model's dtype ignore the scales.

Padding is read, then masked: decode chunks gather whole blocks (and block-table padding points at block 0), so
every slot of a block that appears in a block table, and all of block 0, must hold finite values, since a masked
NaN still poisons SDPA (0 * nan = nan). The worker's KV cache (`workers/kv_cache.py`) guarantees it by zeroing
each block the first time it is handed out; after that a slot holds zeros or stale but finite keys and values.

`AttentionMetadata` is built once per step (`workers/step_inputs.py`) and shared by every layer; whatever can be
precomputed for the whole step (decode chunks and masks, per-sequence causal masks) is built there, not per layer.

Which implementation runs is decided in one place, `workers/backends.py`, which depends on the backends here and in
`workers/cpu_backend.py` and `workers/triton_backend.py`, never the other way round. Each backend builds its own
step metadata (`prepare(step) -> AttentionMetadata`, from the step's host arrays, once per step) and runs one layer
(`forward(q, k, v, kv_cache, layer, metadata)`: write this step's K/V, then attend); the metadata carries its backend,
so every layer of a step uses the same one. A layer's constants (scale, sliding window, fp8 KV scales) travel as one
`AttentionLayer`, which the model's attention module holds. The torch code below is the reference and the fallback:
SDPA through the block tables. It needs decode chunks with their masks and per-sequence prefill groups; the kernels
read only the block-table entries their sequences' lengths cover and need neither (the CPU kernel leaves its longer
sequences to the same prefill groups). Whatever depends on a sliding window is precomputed in `prepare` for each
distinct window the model has (`StepShape.sliding_windows`), never during the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.kernels.kv_quant import as_bytes, dequantize, quantize
from tokenmill.workers import causal_attention
from tokenmill.workers.staging import StepStaging

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (K cache, V cache); workers/kv_cache.py allocates them


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
    # sliding window -> (block ids [n, cols], key mask [n, 1, 1, cols * block_size]), built in prepare
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


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
    # sliding window -> (first block read, [q_len, keys read] mask), built in prepare
    windowed: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass
class MixedBatchSplit:
    """A mixed step in decode-first order (`workers/request_state.py`): its first `num_decode_seqs` sequences have
    one query token each (rows [0, num_decode_seqs) of the flat batch), the rest are prefill chunks (the rows after).
    The Triton backend sends each slice through its own kernel."""

    num_decode_seqs: int
    decode_max_seq_len: int  # the decode sequences' longest context (the split-KV rule's input, a host value)
    prefill_query_start_loc: torch.Tensor  # [Bp + 1] int32: the prefill sequences' query starts, from 0


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
    backend: AttentionBackend  # the implementation that built this metadata and runs every layer over it
    decode: DecodeGroup | None = None  # torch backend: the single-token sequences, batched
    prefills: list[PrefillSequence] = field(default_factory=list)  # the sequences a backend leaves to SDPA
    mixed: MixedBatchSplit | None = None  # Triton backend: a mixed step's decode and prefill slices

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass
class AttentionLayer:
    """One attention layer's constants, held by the model's attention module and handed to the backend whole.

    `sliding_window` (None: full attention): a query at position p attends to keys p - window < k <= p, as
    transformers' sliding-window mask (Mistral, Qwen2 `use_sliding_window`, Gemma 3's local layers). `k_scale`,
    `v_scale`: an fp8 cache stores key / k_scale and value / v_scale (a cache in the model's dtype ignores them)."""

    scale: float
    sliding_window: int | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of keys, got {self.sliding_window}")


@dataclass(frozen=True)
class StepShape:
    """A step's flat batch as host arrays, what every backend's `prepare` starts from."""

    query_lens: np.ndarray  # [B] int64
    seq_lens: np.ndarray  # [B] int64: tokens in the cache after this step
    block_tables: np.ndarray  # [B, max_blocks] int64
    block_size: int
    device: torch.device
    decode_chunk_tokens: int | None = None  # torch decode: keys per chunk; None: every decode sequence in one chunk
    sliding_windows: tuple[int, ...] = ()  # the model's distinct windows, whose reads are precomputed
    staging: StepStaging | None = None  # the step's one host-to-device copy (workers/staging.py); None: a copy each

    def to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A host array as a `dtype` tensor on the step's device: packed into the step's staging when it has one."""
        if self.staging is not None:
            return self.staging.upload(np.ascontiguousarray(array), dtype)
        return _to_device(array, dtype, self.device)


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


def _one_token_each(query_lens: np.ndarray) -> bool:
    """Whether every sequence has exactly one query token (a decode-only step; an empty step counts as one)."""
    return bool((query_lens == 1).all())


def token_positions(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Positions `[T]` of a flat batch: sequence b's query i sits at seq_lens[b] - query_lens[b] + i."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if _one_token_each(query_lens):  # decoding: each sequence's last position (the common case, cheaply)
        last: np.ndarray = seq_lens - 1
        return last
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    first_token = np.cumsum(query_lens) - query_lens
    positions: np.ndarray = (
        np.arange(int(query_lens.sum())) - first_token[seq_of_token] + (seq_lens - query_lens)[seq_of_token]
    )
    return positions


def build_attention_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    device: torch.device,
    backend: AttentionBackend,
    decode_chunk_tokens: int | None = None,
    sliding_windows: tuple[int, ...] = (),
    staging: StepStaging | None = None,
) -> AttentionMetadata:
    """`backend`'s metadata for a step given as host arrays: query_lens[B], seq_lens[B], block_tables[B, max_blocks].
    With `staging`, its device tensors are views filled by the staging's next flush."""
    return backend.prepare(
        StepShape(
            np.asarray(query_lens, dtype=np.int64),
            np.asarray(seq_lens, dtype=np.int64),
            np.asarray(block_tables, dtype=np.int64),
            block_size,
            device,
            decode_chunk_tokens,
            sliding_windows,
            staging,
        )
    )


def _to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)


def common_metadata(
    step: StepShape,
    backend: AttentionBackend,
    decode: DecodeGroup | None = None,
    prefills: list[PrefillSequence] | None = None,
) -> AttentionMetadata:
    """What every backend reads: slots, block tables, query starts, lengths; with a backend's own extras."""
    query_lens, seq_lens, block_size = step.query_lens, step.seq_lens, step.block_size
    num_seqs = len(query_lens)
    decode_only = _one_token_each(query_lens)
    if decode_only:  # token i is sequence i's one query (no cumsum, repeat or second positions pass)
        query_start_loc = np.arange(num_seqs + 1, dtype=np.int64)
        seq_of_token = query_start_loc[:-1]
    else:
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = seq_lens - 1 if decode_only else token_positions(query_lens, seq_lens)
    slot_mapping = step.block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata(
        slot_mapping=step.to_device(slot_mapping, torch.int64),
        block_tables=step.to_device(step.block_tables, torch.int32),
        query_start_loc=step.to_device(query_start_loc, torch.int32),
        seq_lens=step.to_device(seq_lens, torch.int32),
        is_decode_only=decode_only,
        max_query_len=int(query_lens.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        block_size=block_size,
        backend=backend,
        decode=decode,
        prefills=prefills if prefills is not None else [],
    )


def decode_group(step: StepShape) -> DecodeGroup | None:
    """The single-token sequences in chunks for batched SDPA (the torch backend's decode path); None if there are
    none. Each chunk's sliding-window reads are precomputed for the step's windows."""
    is_decode = step.query_lens == 1
    if not is_decode.any():
        return None
    seq_lens, block_size = step.seq_lens, step.block_size
    blocks_needed = -(-seq_lens // block_size)
    decode_seqs = np.flatnonzero(is_decode)
    chunks = []
    for start, end in _decode_chunk_bounds(blocks_needed[decode_seqs] * block_size, step.decode_chunk_tokens):
        chunk_seqs = decode_seqs[start:end]
        chunk_lens = seq_lens[chunk_seqs]
        num_keys = int(chunk_lens.max())
        key_mask = None
        if (chunk_lens != num_keys).any():
            in_sequence = (np.arange(num_keys)[None, :] < chunk_lens[:, None])[:, None, None, :]
            key_mask = step.to_device(in_sequence, torch.bool)
        num_blocks = int(blocks_needed[chunk_seqs].max())
        chunk = DecodeChunk(
            start,
            end,
            step.to_device(step.block_tables[chunk_seqs, :num_blocks], torch.int64),
            num_keys,
            key_mask,
            step.to_device(chunk_lens, torch.int64),
        )
        if step.staging is not None and any(num_keys > w for w in step.sliding_windows):
            step.staging.flush()  # the window reads are computed from the chunk's device tensors: send them first
        chunk.windowed = {w: _decode_window(chunk, w, block_size) for w in step.sliding_windows if num_keys > w}
        chunks.append(chunk)
    token_indices = None
    if not is_decode.all():
        first_rows = np.cumsum(step.query_lens) - step.query_lens
        token_indices = step.to_device(first_rows[decode_seqs], torch.int64)
    return DecodeGroup(token_indices=token_indices, chunks=chunks)


def prefill_sequences(step: StepShape, max_kernel_query_len: int) -> list[PrefillSequence]:
    """One SDPA group per sequence of more than `max_kernel_query_len` query tokens, its sliding-window reads
    precomputed for the step's windows."""
    if not step.query_lens.size or int(step.query_lens.max()) <= max_kernel_query_len:
        return []  # every sequence is the kernel's (a decode step): nothing to compute
    query_start_loc = np.concatenate([[0], np.cumsum(step.query_lens)])
    prefills = []
    for seq in np.flatnonzero(step.query_lens > max_kernel_query_len):
        q_len, seq_len = int(step.query_lens[seq]), int(step.seq_lens[seq])
        causal_mask = None
        if q_len != seq_len:
            query_positions = np.arange(seq_len - q_len, seq_len)
            causal_mask = step.to_device(np.arange(seq_len)[None, :] <= query_positions[:, None], torch.bool)
        num_blocks = -(-seq_len // step.block_size)
        sequence = PrefillSequence(
            query_start=int(query_start_loc[seq]),
            query_end=int(query_start_loc[seq + 1]),
            seq_len=seq_len,
            block_ids=step.to_device(step.block_tables[seq, :num_blocks], torch.int64),
            causal_mask=causal_mask,
        )
        sequence.windowed = {
            w: _prefill_window(sequence, w, step.block_size, step.device) for w in step.sliding_windows if seq_len > w
        }
        prefills.append(sequence)
    return prefills


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
    lens = chunk.seq_lens
    assert lens is not None  # set by decode_group
    first_key = (lens - window).clamp(min=0)
    first_block = first_key // block_size
    num_cols = min(chunk.block_tables.shape[1], (window - 1 + block_size - 1) // block_size + 1)
    cols = first_block[:, None] + torch.arange(num_cols, device=lens.device)
    block_ids = chunk.block_tables.gather(1, torch.minimum(cols, ((lens - 1) // block_size)[:, None]))
    positions = first_block[:, None] * block_size + torch.arange(num_cols * block_size, device=lens.device)
    mask = ((positions >= first_key[:, None]) & (positions < lens[:, None]))[:, None, None, :]
    return block_ids, mask


def _prefill_window(
    seq: PrefillSequence, window: int, block_size: int, device: torch.device
) -> tuple[int, torch.Tensor]:
    """(first block read, `[q_len, keys read]` mask) of a multi-token sequence under a sliding window: keys are read
    from the block of the first query's first visible key on."""
    first_query = seq.seq_len - (seq.query_end - seq.query_start)
    first_block = max(0, first_query - window + 1) // block_size
    positions = torch.arange(first_block * block_size, seq.seq_len, device=device)
    return first_block, sliding_window_mask(positions[first_query - first_block * block_size :], positions, window)


def _attend_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, layer: AttentionLayer
) -> torch.Tensor:
    """Single-token queries `[Bd, Hq, D]`: per chunk of sequences, gather their blocks (dequantized from an fp8
    cache) and run one masked SDPA."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    window = layer.sliding_window
    # Grouped-query attention without repeating K/V: the G query heads sharing a KV head act as G query rows.
    grouped_query = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(grouped_query)
    for chunk in group.chunks:
        shape = (chunk.end - chunk.start, -1, num_kv_heads, head_dim)
        block_ids, key_mask, num_keys = chunk.block_tables, chunk.key_mask, chunk.num_keys
        if window is not None and chunk.num_keys > window:
            windowed = chunk.windowed.get(window)  # a window prepare was not told of (a test's): built here
            block_ids, window_mask = windowed if windowed is not None else _decode_window(chunk, window, block_size)
            key_mask, num_keys = window_mask, window_mask.shape[-1]
        flat_blocks = block_ids.reshape(-1)
        keys = k_cache.index_select(0, flat_blocks).view(shape)[:, :num_keys].transpose(1, 2)
        values = v_cache.index_select(0, flat_blocks).view(shape)[:, :num_keys].transpose(1, 2)
        keys, values = dequantize(keys, layer.k_scale, query.dtype), dequantize(values, layer.v_scale, query.dtype)
        out[chunk.start : chunk.end] = F.scaled_dot_product_attention(
            grouped_query[chunk.start : chunk.end], keys, values, attn_mask=key_mask, scale=layer.scale
        )
    return out.view(num_seqs, num_heads, head_dim)


def attend_prefills_sdpa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: list[PrefillSequence],
    layer: AttentionLayer,
    output: torch.Tensor,
) -> None:
    """Into `output`'s rows of each multi-token sequence, its causal attention: one SDPA call per sequence.

    With a sliding window, keys are read from the block of the first query's first visible key on. An fp8 cache's
    keys and values are dequantized after the gather. Float32 on the CPU without a window cut, the causal triangle is
    split so no masked half is computed (`workers/causal_attention.py`).
    """
    block_size = k_cache.shape[1]
    window = layer.sliding_window
    for seq in prefills:
        # 4-d [1, heads, len, D]: torch's CPU SDPA takes a far slower path for 3-d GQA inputs with a mask.
        seq_query = query[seq.query_start : seq.query_end].transpose(0, 1)[None]
        block_ids, num_keys, mask = seq.block_ids, seq.seq_len, seq.causal_mask
        if window is not None and seq.seq_len > window:
            windowed = seq.windowed.get(window)  # a window prepare was not told of (a test's): built here
            first_block, mask = (
                windowed if windowed is not None else _prefill_window(seq, window, block_size, query.device)
            )
            block_ids, num_keys = block_ids[first_block:], seq.seq_len - first_block * block_size
        keys = dequantize(_gather_sequence(k_cache, block_ids, num_keys)[None], layer.k_scale, query.dtype)
        values = dequantize(_gather_sequence(v_cache, block_ids, num_keys)[None], layer.v_scale, query.dtype)
        if (window is None or seq.seq_len <= window) and causal_attention.takes(seq_query):  # plainly causal
            seq_out = causal_attention.causal_prompt_attention(seq_query, keys, values, layer.scale)
        else:
            seq_out = F.scaled_dot_product_attention(
                seq_query, keys, values, attn_mask=mask, is_causal=mask is None, scale=layer.scale, enable_gqa=True
            )
        output[seq.query_start : seq.query_end] = seq_out[0].transpose(0, 1)


def paged_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    layer: AttentionLayer,
) -> torch.Tensor:
    """Causal attention of query `[T, Hq, D]` over each sequence's cached keys/values; returns `[T, Hq, D]`.

    The caches must already hold this step's keys and values."""
    decode = metadata.decode
    if metadata.is_decode_only and decode is not None:
        return _attend_decode(query, k_cache, v_cache, decode, layer)
    output = torch.empty_like(query)
    if decode is not None:
        assert decode.token_indices is not None  # set whenever the batch is not all decode
        decoded = _attend_decode(query.index_select(0, decode.token_indices), k_cache, v_cache, decode, layer)
        output.index_copy_(0, decode.token_indices, decoded)
    attend_prefills_sdpa(query, k_cache, v_cache, metadata.prefills, layer, output)
    return output


# ---------------------------------------------------------------- the backend interface


class AttentionBackend(Protocol):
    """One implementation of paged attention: its own per-step metadata, then each layer's KV write and attention."""

    def prepare(self, step: StepShape) -> AttentionMetadata:
        """The step's metadata, built once and shared by every layer."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        layer: AttentionLayer,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Store this step's key/value `[T, Hkv, D]` in the layer's cache, then attend: `[T, Hq, D]`."""
        ...


class TorchAttentionBackend:
    """Pure torch: gathers through the block tables and calls SDPA (batched for single-token sequences)."""

    write_kv = staticmethod(write_kv_torch)

    def prepare(self, step: StepShape) -> AttentionMetadata:
        return common_metadata(step, self, decode_group(step), prefill_sequences(step, max_kernel_query_len=1))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        layer: AttentionLayer,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        self.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, layer.k_scale, layer.v_scale)
        return paged_attention_torch(query, k_cache, v_cache, metadata, layer)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    layer: AttentionLayer,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """One layer's paged attention on the backend that built `metadata`: what the models call."""
    return metadata.backend.forward(query, key, value, kv_cache, layer, metadata)
