"""A stand-in for the CUDA caching allocator's peak statistics on CPU: the bytes of tensor storage alive, counted
through a TorchDispatchMode, so a test can run code written for `torch.cuda.max_memory_reserved` and read its peak.

Every storage an op creates counts from the op until its last tensor dies (a weak reference's finalizer); storages
that existed before the mode (the weights) and views of them count nothing. Host tensors made without an op
(`torch.tensor(list)`, `torch.from_numpy`) are not seen: on a GPU they are host memory too.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as live: ...`, then `live.peak`: the most storage bytes alive at once since entry (or since
    `reset_peak`)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage data pointer -> bytes
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    def _release(self, pointer: int) -> None:
        self.current -= self.live.pop(pointer, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t).data_ptr() for t in tree_flatten((args, kwargs))[0] if _storage(t) is not None}
        for tensor in tree_flatten(out)[0]:
            storage = _storage(tensor)
            if storage is None:
                continue
            pointer = storage.data_ptr()
            if pointer == 0 or pointer in inputs or pointer in self.live:
                continue
            self.live[pointer] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, pointer)
        return out


def _storage(value: object) -> torch.UntypedStorage | None:
    """A tensor's storage; None for what is no tensor or has none to count (oneDNN's opaque packed weights)."""
    if not isinstance(value, torch.Tensor) or value.is_mkldnn:
        return None
    return value.untyped_storage()
