"""The tensor-parallel all-reduce, and the one hook through which a CUDA-graph capture keeps it out of a graph.

Every all-reduce of a model's forward (`TensorParallel.all_reduce`: the row-parallel linears, the vocab-parallel
embedding, the MoE experts) goes through `all_reduce` here. Normally it runs at once. While `collectives_split_capture`
is active (the decode-graph capture under tensor parallelism, `workers/cuda_graphs.py`), it calls the capture's
boundary instead: the capture ends the graph being recorded there, notes the tensor, and starts the next one, so
the collective runs eagerly between two replayed segments and is never recorded inside a graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# (tensor to all-reduce in place, its group): what a capture does at a collective instead of running it
SegmentBoundary = Callable[[torch.Tensor, ProcessGroup | None], None]

_boundary: ContextVar[SegmentBoundary | None] = ContextVar("collective_segment_boundary", default=None)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """Sum `tensor` in place over `group`; inside a splitting capture, end the captured segment there instead."""
    boundary = _boundary.get()
    if boundary is not None:
        boundary(tensor, group)
    else:
        dist.all_reduce(tensor, group=group)


@contextmanager
def collectives_split_capture(boundary: SegmentBoundary) -> Iterator[None]:
    """While active, every `all_reduce` calls `boundary` instead of reducing."""
    token = _boundary.set(boundary)
    try:
        yield
    finally:
        _boundary.reset(token)
