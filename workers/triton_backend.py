"""The CUDA attention backend and layer ops (`workers/backends.py` picks them): the Triton kernels from `kernels/`.

Per layer the KV write scatters this step's keys and values to their slots (slot -1, a CUDA-graph padding row, is
skipped); attention runs the split-KV decode kernel on the sequences with one query token (its split count chosen
from their number, kv heads and longest visible context against the device's SMs) and the varlen prefill kernel on
the others (prompts, chunks, prefix-cache hits, drafts). A mixed step comes decode-first (`workers/request_state.py`,
vLLM's `reorder_batch`), so `prepare` records where its decode rows end and each kernel runs on its own contiguous
slice of the one forward; sequences of one query after the first longer one (a batch built in another order) are
left to the prefill kernel, which is correct for them too.
The layers' RMSNorm (with the residual add fused) and rotary embedding use the matching kernels.

Everything here reads only tensors from `AttentionMetadata` (no host values, no syncs), so a decode step built on
static buffers can be captured in a CUDA graph (`workers/cuda_graphs.py`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tokenmill.kernels.kv_write import write_kv
from tokenmill.kernels.moe_grouped_gemm import moe_experts
from tokenmill.kernels.paged_attention import paged_attention_prefill
from tokenmill.kernels.rms_norm import rms_norm
from tokenmill.kernels.rotary import apply_rotary
from tokenmill.kernels.split_kv_decode import choose_num_splits, split_kv_decode
from tokenmill.workers.attention import (
    AttentionLayer,
    AttentionMetadata,
    KVCache,
    MixedBatchSplit,
    StepShape,
    common_metadata,
)
from tokenmill.workers.ops import LayerOps


def rotate_in_place(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (views of the fused QKV output) in place by looking their positions up in the table."""
    return apply_rotary(q, k, positions, cos_sin_table, neox_style=True, inplace=True)


# Without CUDA (the interpreter in tests) a few "SMs": long contexts still split, short batches stay cheap to interpret.
INTERPRETER_SM_COUNT = 8


@functools.cache
def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the split-KV rule's target), else INTERPRETER_SM_COUNT."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(
    num_seqs: int, max_seq_len: int, num_kv_heads: int, device: torch.device, sliding_window: int | None
) -> int:
    """The split-KV decode kernel's split count for `num_seqs` decode sequences, from host values only (graph-safe)."""
    visible = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    return choose_num_splits(num_seqs, num_kv_heads, visible, device_sm_count(device))


def mixed_batch_split(step: StepShape) -> MixedBatchSplit | None:
    """Where a step's leading one-query sequences end, when both they and longer ones are in it; else None."""
    is_decode = step.query_lens == 1
    num_decode = len(is_decode) if is_decode.all() else int(np.argmin(is_decode))
    if num_decode == 0 or num_decode == len(is_decode):
        return None
    prefill_query_start_loc = np.zeros(len(is_decode) - num_decode + 1, dtype=np.int32)
    np.cumsum(step.query_lens[num_decode:], out=prefill_query_start_loc[1:])
    return MixedBatchSplit(
        num_decode,
        int(step.seq_lens[:num_decode].max()),
        step.to_device(prefill_query_start_loc, torch.int32),
    )


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    layer: AttentionLayer,
) -> torch.Tensor:
    """Attention of query `[T, Hq, D]` over the paged cache (already holding this step's K/V); returns `[T, Hq, D]`.

    With a sliding window, a query at position p sees keys p - window < k <= p (the kernels start at the window).
    An fp8 cache holds keys / k_scale and values / v_scale (plain floats: a captured CUDA graph keeps them)."""
    if metadata.is_decode_only:
        return decode_attention(query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                metadata.max_seq_len, layer)  # fmt: skip
    mixed = metadata.mixed
    if mixed is None:
        return prefill_attention(
            query, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens, layer
        )
    decodes = mixed.num_decode_seqs  # also their rows: one query token each
    output = torch.empty_like(query)
    output[:decodes] = decode_attention(
        query[:decodes], k_cache, v_cache, metadata.block_tables[:decodes], metadata.seq_lens[:decodes],
        mixed.decode_max_seq_len, layer,
    )  # fmt: skip
    output[decodes:] = prefill_attention(
        query[decodes:], k_cache, v_cache, metadata.block_tables[decodes:], mixed.prefill_query_start_loc,
        metadata.seq_lens[decodes:], layer,
    )  # fmt: skip
    return output


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    layer: AttentionLayer,
) -> torch.Tensor:
    """One query per sequence: the one call into the split-KV decode kernel (`kernels/split_kv_decode.py`)."""
    num_splits = decode_num_splits(
        int(seq_lens.shape[0]), max_seq_len, k_cache.shape[2], query.device, layer.sliding_window
    )
    return split_kv_decode(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        layer.scale,
        num_splits,
        layer.sliding_window,
        layer.k_scale,
        layer.v_scale,
    )


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    layer: AttentionLayer,
) -> torch.Tensor:
    """Varlen causal queries (any lengths): the one call into the prefill kernel (`kernels/paged_attention.py`)."""
    return paged_attention_prefill(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        layer.scale,
        layer.sliding_window,
        layer.k_scale,
        layer.v_scale,
    )


class TritonAttentionBackend:
    """KV write and paged attention as Triton kernels, which need only the common metadata (no host values, so a
    decode step over static buffers can be captured in a CUDA graph)."""

    write_kv = staticmethod(write_kv)

    def prepare(self, step: StepShape) -> AttentionMetadata:
        metadata = common_metadata(step, self)
        metadata.mixed = mixed_batch_split(step)
        return metadata

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
        return paged_attention_triton(query, k_cache, v_cache, metadata, layer)


# SiLU-and-mul stays torch (one fused op there); MoE experts run the grouped GEMM
TRITON_OPS = LayerOps(rms_norm=rms_norm, rotary=rotate_in_place, moe_experts=moe_experts)
