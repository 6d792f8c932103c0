"""Host memory on 2 MiB pages for what the CPU kernels read every step: the GGUF weights, all in one region.

The engine's children ask torch's allocator for transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`,
tokenmill/launcher.py), which it gives allocations of 2 MiB and more: the KV caches, the LM head, a large model's
weights. A small model's per-layer weights are each below that (SmolLM2's 0.2-1.1 MB) and sat on 4 KiB pages: a TLB
miss every 4 KiB of a weight stream and a hardware prefetcher stopped at every page edge. Gathered into one region on
huge pages, the batch-1 GEMVs of every SmolLM2 shape ran 1.05-1.09x faster (Q4_1, Q8_0; docs/benchmarks.md). Linux
backs anonymous memory with huge pages only where the range is 2 MiB aligned and, in the common `madvise` mode,
advised before its pages are first touched: so the region is over-allocated by 2 MiB, cut at the first aligned byte
and advised (`MADV_HUGEPAGE`) before anything writes it. Where the advice is refused (THP off, another OS) the memory
is ordinary pages; nothing else changes. `TOKENMILL_HUGE_PAGES=0` turns the advice off (to measure against it).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

import torch

from tokenmill.workers.quantization.gguf import GGUFWeight

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
ALIGNMENT = 64  # each weight's blocks start on a cache line


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux") or os.environ.get("TOKENMILL_HUGE_PAGES", "1") == "0":
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes` starting on a 2 MiB boundary, advised for huge pages."""
    backing = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -backing.data_ptr() % HUGE_PAGE
    region = backing[offset : offset + nbytes]  # a view: it keeps `backing` alive
    madvise = _madvise()
    if madvise is not None and nbytes > 0 and madvise(region.data_ptr(), nbytes, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    return region


def gather_gguf_weights(model: torch.nn.Module) -> int:
    """Copy the blocks of every GGUF weight of `model` into one huge-page region, each weight's `blocks` a view of it
    (same bytes, same shape; a weight shared by two modules moved once); returns the bytes moved. Call it after the
    weights are loaded and repacked, before any matmul closure or recording has taken their addresses."""
    # modules() yields a module shared by two parents (a tied embedding and LM head) once
    weights = [module for module in model.modules() if isinstance(module, GGUFWeight)]
    sizes = [weight.blocks.numel() for weight in weights]
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // ALIGNMENT) * ALIGNMENT
    if total == 0:
        return 0
    region = huge_page_bytes(total)
    for weight, start, size in zip(weights, starts, sizes, strict=True):
        blocks = region[start : start + size].view(weight.blocks.shape)
        blocks.copy_(weight.blocks)
        weight.blocks = blocks  # the old blocks are freed as each weight moves, so the copy never doubles the model
    return sum(sizes)
