"""How many KV blocks fit on a GPU: the shape of the worst-case step the worker profiles, and the budget arithmetic.

Counted against `gpu_memory_utilization` of the GPU: the weights and a worst-case step's activations (profiled),
memory taken outside torch's allocator since start-up (NCCL, cuBLAS workspaces), and the decode CUDA graphs' pool.
Other processes on the GPU (a second instance) are respected by never taking more than is free now, less the
activations and graphs still to come. The CUDA context, created before the start-up snapshot, is left out.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)


class WorstCaseStep(NamedTuple):
    """A step of max_num_batched_tokens tokens in sequences of max_model_len, each in its own blocks."""

    seq_lens: np.ndarray  # [B] int64: every sequence a whole prompt
    block_tables: np.ndarray  # [B, max blocks] int64
    num_blocks: int


def worst_case_step(max_num_batched_tokens: int, max_model_len: int, block_size: int) -> WorstCaseStep:
    seq_lens = [max_model_len] * (max_num_batched_tokens // max_model_len)
    if max_num_batched_tokens % max_model_len:
        seq_lens.append(max_num_batched_tokens % max_model_len)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    block_tables = np.zeros((len(seq_lens), max(blocks_per_seq)), dtype=np.int64)
    next_block = 0
    for row, count in enumerate(blocks_per_seq):
        block_tables[row, :count] = np.arange(next_block, next_block + count)
        next_block += count
    return WorstCaseStep(np.array(seq_lens, dtype=np.int64), block_tables, next_block)


class ProfiledStep(NamedTuple):
    """What the worst-case step took on top of the weights, KV excluded (bytes reserved by torch at its peaks)."""

    num_tokens: int
    forward_peak: int  # weights + the forward's activations
    peak: int  # weights + the whole step: forward, prompt-logprobs chunk and sample stage

    @property
    def sampler_bytes(self) -> int:
        """What the step's tail (LM head, prompt logprobs, sampler) added to the forward's peak."""
        return max(0, self.peak - self.forward_peak)

    def log(self) -> None:
        log.info(
            "profiled a %d-token step: %.2f GiB peak besides the KV cache, of which the sample stage adds %.2f GiB",
            self.num_tokens,
            self.peak / 2**30,
            self.sampler_bytes / 2**30,
        )


class GpuMemory(NamedTuple):
    """Byte counts read from CUDA while the worker starts."""

    free_at_start: int  # free before any weight was loaded
    total: int
    free_now: int  # after loading and profiling
    held_by_torch: int  # reserved by torch's allocator now: the weights (the profile's activations are released)
    peak: int  # weights + the worst-case step's activations


def kv_blocks_in_budget(memory: GpuMemory, utilization: float, block_bytes: int, graph_share: float) -> int:
    """The KV blocks that fit; `graph_share`: the decode graphs' pool as a fraction of the profiled activations.
    Raises when none does."""
    activations = max(0, memory.peak - memory.held_by_torch)
    outside_torch = max(0, memory.free_at_start - memory.free_now - memory.held_by_torch)
    graphs = int(activations * graph_share)
    allowed = utilization * memory.total
    budget = min(allowed - memory.peak - outside_torch - graphs, memory.free_now - activations - graphs)
    num_blocks = int(budget // block_bytes)
    kv_bytes = max(0, num_blocks) * block_bytes
    gib = [
        n / 2**30 for n in (memory.total, allowed, memory.held_by_torch, activations, outside_torch, graphs, kv_bytes)
    ]
    log.info(
        "GPU memory (GiB): %.2f total, %.2f allowed; weights and buffers %.2f, activations %.2f, "
        "outside torch %.2f, decode graphs ~%.2f; KV cache %.2f",
        *gib,
    )
    if num_blocks <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: weights and activations take {memory.peak / 2**30:.2f} GiB, "
            f"{memory.free_now / 2**30:.2f} GiB is free and {utilization:.2f} of {memory.total / 2**30:.2f} GiB "
            "is allowed; raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return num_blocks
