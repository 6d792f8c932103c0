"""The CPU attention backend and layer ops (`workers/backends.py` picks them) when the compiled kernels of `kernels/cpu_ops.cpp` are available.

Decode tokens attend straight from the KV blocks in one kernel call per layer (no gather, no masks); multi-token
sequences (prompts, chunks, prefix-cache hits) keep torch's SDPA, which is matmul-bound there and already fast. The
KV write, the RMSNorm with its residual add, the rotary embedding and SiLU(gate) * up are one kernel call each
instead of a chain of small torch ops.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu_ops
from tokenmill.workers.attention import AttentionMetadata, attend_prefills_sdpa
from tokenmill.workers.ops import LayerOps


def paged_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of query `[T, Hq, D]` over the paged cache (already holding this step's K/V); returns `[T, Hq, D]`.

    With `sliding_window`, a query at position p sees keys p - window < k <= p; neither path reads a block before
    the window's first. An fp8 cache holds keys / k_scale and values / v_scale."""
    output = torch.empty(query.shape, dtype=query.dtype)
    if len(metadata.prefills) < metadata.seq_lens.shape[0]:  # some sequence decodes one token
        cpu_ops.decode_attention(output, query, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc,
                                 metadata.seq_lens, scale, sliding_window, k_scale, v_scale)
    attend_prefills_sdpa(query, k_cache, v_cache, metadata.prefills, scale, output, sliding_window, k_scale, v_scale)
    return output


class CpuKernelBackend:
    """Decode attention and the KV write as compiled CPU kernels; prompts through SDPA."""

    builds_decode_chunks = False
    builds_prefill_groups = True
    write_kv = staticmethod(cpu_ops.write_kv)
    attend = staticmethod(paged_attention_cpu)


CPU_KERNEL_OPS = LayerOps(rms_norm=cpu_ops.rms_norm, rotary=cpu_ops.rotary, silu_and_mul=cpu_ops.silu_and_mul)
