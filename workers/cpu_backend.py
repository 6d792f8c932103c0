"""The CPU attention backend and layer ops (`workers/backends.py` picks them) when the compiled kernels of
`kernels/cpu_ops.cpp` are available.

Sequences of up to `MAX_KERNEL_QUERY_LEN` query tokens (decode tokens, a speculative-decoding verification step's
1 + k tokens, short prompts) attend straight from the KV blocks in one kernel call per layer (no gather, no masks;
each block read once for all of a sequence's queries); longer ones (prompts, chunks, prefix-cache hits) keep torch's
SDPA, which is matmul-bound there and already fast. The KV write, the RMSNorm with its residual add, the rotary
embedding and SiLU(gate) * up are one kernel call each instead of a chain of small torch ops.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu_ops
from tokenmill.workers.attention import (
    AttentionLayer,
    AttentionMetadata,
    KVCache,
    StepShape,
    attend_prefills_sdpa,
    common_metadata,
    prefill_sequences,
)
from tokenmill.workers.ops import LayerOps

# The most query tokens of a sequence the attention kernel takes: a verification step's 1 + k (k <= 7 at
# scheduler/spec_decode.py's STEP_TOKEN_BUDGET) with room to spare. The kernel's cost grows with queries x keys while
# SDPA's gather is paid once: one thread, SmolLM2's heads, the kernel against the prompt path per layer call was
# 85 / 123 us at 8 queries over 200 keys, 165 / 187 us at 16, and even (702 / 685 us) at 16 over 1000 keys.
MAX_KERNEL_QUERY_LEN = 16


def paged_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    layer: AttentionLayer,
    max_kernel_query_len: int,
) -> torch.Tensor:
    """Attention of query `[T, Hq, D]` over the paged cache (already holding this step's K/V); returns `[T, Hq, D]`.

    Sequences of up to `max_kernel_query_len` query tokens go through the kernel, the longer ones
    (`metadata.prefills`) through SDPA. With a sliding window, a query at position p sees keys p - window < k <= p;
    neither path reads a block before the window of a sequence's earliest query. An fp8 cache holds keys / k_scale
    and values / v_scale."""
    output = torch.empty(query.shape, dtype=query.dtype)
    if len(metadata.prefills) < metadata.seq_lens.shape[0]:  # some sequence is short enough for the kernel
        cpu_ops.decode_attention(
            output,
            query,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            layer.scale,
            layer.sliding_window,
            layer.k_scale,
            layer.v_scale,
            max_kernel_query_len,
        )
    attend_prefills_sdpa(query, k_cache, v_cache, metadata.prefills, layer, output)
    return output


class CpuKernelBackend:
    """Attention of short sequences (decode, verification) and the KV write as compiled CPU kernels; prompts through
    SDPA, which needs the longer sequences' prefill groups and nothing else."""

    write_kv = staticmethod(cpu_ops.write_kv)

    def __init__(self, max_kernel_query_len: int = MAX_KERNEL_QUERY_LEN) -> None:
        self.max_kernel_query_len = max_kernel_query_len

    def prepare(self, step: StepShape) -> AttentionMetadata:
        return common_metadata(step, self, prefills=prefill_sequences(step, self.max_kernel_query_len))

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
        return paged_attention_cpu(query, k_cache, v_cache, metadata, layer, self.max_kernel_query_len)


CPU_KERNEL_OPS = LayerOps(rms_norm=cpu_ops.rms_norm, rotary=cpu_ops.rotary, silu_and_mul=cpu_ops.silu_and_mul)
