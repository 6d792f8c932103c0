"""The paged KV cache's tensors: their size, their allocation, and zeroing each block the first time it is used.

Layout (shared with every attention backend and the kernels): per layer a K and a V cache, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. A draft model (speculative decoding) keeps its own tensors,
indexed by the same block ids, so one block's bytes are the target's layers plus the draft's.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tokenmill.kernels.kv_quant import as_bytes

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (K cache, V cache)


class PagedModel(Protocol):
    """The shape of a decoder's paged KV cache (every causal model in `workers/models/` has these)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...


class DraftKV(Protocol):
    """A draft model's side of the cache (`workers/draft_proposer.py`)."""

    kv_caches: list[KVCache]

    def allocate_kv_cache(self, num_blocks: int) -> None: ...


def kv_block_bytes(model: PagedModel, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across every layer of `model`, K and V."""
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * dtype.itemsize


def allocate_kv_caches(
    model: PagedModel, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    """Per layer of `model` a K and a V cache of `model.kv_cache_shape`, zero-filled: writing every page now makes
    the whole pool resident at start (an overcommitted host fails here, not hours later as blocks are first used)."""
    shape = model.kv_cache_shape(num_blocks, block_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(model.num_layers)
    ]


def zero_kv_blocks(kv_caches: list[KVCache], block_runs: list[tuple[int, int]]) -> None:
    """Zero the blocks [start, end) of each run in every layer's K and V cache, as bytes (byte 0 is +0.0 in every
    cache dtype). Runs of host ints rather than an index tensor: zeroing sends nothing to the device, so a step's
    inputs stay one copy (`workers/staging.py`)."""
    for k_cache, v_cache in kv_caches:
        for start, end in block_runs:
            as_bytes(k_cache)[start:end].zero_()
            as_bytes(v_cache)[start:end].zero_()


def block_runs(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted, distinct block ids as [start, end) runs of consecutive ids."""
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(sorted_ids, breaks)]


class PagedKVCache:
    """The worker's KV tensors (the target's and a draft's), each block zeroed the first time a plan hands it out.

    Attention reads padding and masks it (attention.py), so every block a block table names must hold finite values;
    zeroing on first use keeps that true without touching the whole cache up front. Block 0 is zeroed at once: it
    pads block tables."""

    def __init__(
        self,
        model: PagedModel,
        draft: DraftKV | None,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers = allocate_kv_caches(model, num_blocks, block_size, dtype, device)
        self.draft = draft
        if draft is not None:
            draft.allocate_kv_cache(num_blocks)
        self.device = device
        self._never_used = np.ones(num_blocks, dtype=bool)
        self.zero_never_used([0])

    def zero_never_used(self, block_ids: list[int]) -> None:
        """Zero those of `block_ids` no plan handed out before."""
        ids = np.asarray(block_ids, dtype=np.int64)
        fresh = np.unique(ids[self._never_used[ids]])
        if fresh.size == 0:
            return
        self._never_used[fresh] = False
        runs = block_runs(fresh)
        zero_kv_blocks(self.layers, runs)
        if self.draft is not None:
            zero_kv_blocks(self.draft.kv_caches, runs)

    def release(self) -> None:
        """Drop every tensor (after start-up profiling: the real cache is allocated once its size is known)."""
        self.layers = []
        if self.draft is not None:
            self.draft.kv_caches = []
