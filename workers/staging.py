"""A step's inputs reach the device in one copy: packed into one pinned host buffer, sent with one non-blocking copy.

Every per-step input (token ids, positions, the rows to sample, slots, block tables, query starts, sequence
lengths, the backend's extras) is written into one `torch.uint8` host buffer at an aligned offset; the tensor the
step reads is a typed view of the same bytes of a device buffer. `flush()` then sends everything written since the
last flush with one `copy_(..., non_blocking=True)` from pinned memory, which the GPU overlaps with whatever it is
still running; the views are valid (stream-ordered) for every kernel launched after it.

Both buffers persist across steps and grow (doubling) when a step needs more: a step that grows them first
flushes what it had written into the old ones, which its earlier views still point to (the one step that pays a
second copy). Before a step writes into the host buffer again, `begin_step()` waits for the previous copy to have
read it (a recorded event; with the synchronous worker it is long done).

On CPU the "device" is the host: nothing needs packing, so `upload` returns the host array itself as a tensor
(converted where its dtype differs; the caller hands it over and does not change it afterwards) and `flush()`
copies nothing. Packing there cost a batch-1 decode step about a tenth of a millisecond for nothing: seven small
typed copies, each with four views. Pinned memory needs CUDA: only a CUDA device pins. `separate_device=True`
keeps a distinct device buffer even on CPU, with the packing: the stand-in for a GPU with which tests count the
copies a step makes.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGNMENT = 64  # bytes: every view starts on a cache line, at least the alignment of any dtype it holds
INITIAL_BYTES = 1 << 20
# the step inputs' dtypes, as numpy's (`upload` converts host arrays to them before they become tensors)
NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.float32: np.dtype(np.float32),
    torch.bool: np.dtype(np.bool_),
}


class StepStaging:
    """One worker's staging buffers; `upload` packs an array and returns its device view, `flush` sends them."""

    def __init__(self, device: torch.device, separate_device: bool | None = None, initial_bytes: int = INITIAL_BYTES):
        self.device = device
        self.separate_device = device.type != "cpu" if separate_device is None else separate_device
        self.pinned = device.type == "cuda"
        self.num_copies = 0  # flushes that copied (what the copy-count test reads)
        self._used = 0  # bytes written this step
        self._flushed = 0  # of which already sent
        self._copy_done: torch.cuda.Event | None = None
        self._host, self._device = self._allocate(initial_bytes if self.separate_device else 0)  # host: unused

    def _allocate(self, num_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        if not self.separate_device:
            return host, host
        return host, torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    @property
    def device_buffer(self) -> torch.Tensor:
        """The bytes the current views live in (the host buffer itself when the device is the host)."""
        return self._device

    def begin_step(self) -> None:
        """Start a step's staging from offset 0, once the previous step's copy has read the host buffer."""
        if self._copy_done is not None:
            self._copy_done.synchronize()
            self._copy_done = None
        self._used = self._flushed = 0

    def upload(self, array: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`array` (host) as `dtype`, packed into the staging buffer; its device view, filled by the next flush. When
        the device is the host, the array itself as a `dtype` tensor (no copy where it already is one)."""
        if isinstance(array, np.ndarray):  # numpy converts (~2 us a call, where torch.as_tensor then .to took ~8)
            host = torch.from_numpy(np.asarray(array, dtype=NUMPY_DTYPES.get(dtype, array.dtype), order="C"))
        else:
            host = torch.as_tensor(array)
        if host.dtype != dtype or not host.is_contiguous():
            host = host.to(dtype=dtype).contiguous()
        if not self.separate_device:
            return host
        num_bytes = host.numel() * host.element_size()
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if start + num_bytes > self._host.numel():
            self._grow(start + num_bytes)
            start = 0
        self._host[start : start + num_bytes].view(dtype).view(host.shape).copy_(host)
        self._used = start + num_bytes
        return self._device[start : start + num_bytes].view(dtype).view(host.shape)

    def _grow(self, needed: int) -> None:
        """Bigger buffers for the rest of the step (and later steps); what is pending goes out to the old ones."""
        self.flush()
        self._host, self._device = self._allocate(max(needed, 2 * self._host.numel()))
        self._used = self._flushed = 0

    def flush(self) -> None:
        """Send what was written since the last flush: one non-blocking copy (none when the device is the host)."""
        if self._used == self._flushed:
            return
        if self.separate_device:
            pending = slice(self._flushed, self._used)
            self._device[pending].copy_(self._host[pending], non_blocking=True)
            self.num_copies += 1
            if self.device.type == "cuda":
                self._copy_done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
                self._copy_done.record()
        self._flushed = self._used
