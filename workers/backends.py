"""The one device switch: which attention backend and which layer ops run on a device type.

On CUDA, the Triton kernels (`workers/triton_backend.py`); on CPU, the compiled kernels of `kernels/cpu_ops.cpp`
(`workers/cpu_backend.py`) unless `TOKENMILL_CPU_KERNELS=0` or they cannot be built; otherwise plain torch. This
module depends on the backends; none of them depends on it.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

from tokenmill.kernels import cpu_ops
from tokenmill.workers.attention import AttentionBackend, TorchAttentionBackend
from tokenmill.workers.cpu_backend import CPU_KERNEL_OPS, CpuKernelBackend
from tokenmill.workers.ops import TORCH_OPS, LayerOps

# Device types that run the Triton kernels. Tests add "cpu" (with TRITON_INTERPRET=1) to run the kernel path on CPU.
TRITON_DEVICE_TYPES = frozenset({"cuda"})


class DeviceKernels(NamedTuple):
    attention: AttentionBackend
    ops: LayerOps


@functools.cache
def device_kernels(device_type: str) -> DeviceKernels:
    """The implementations for a device type (cached; `device_kernels.cache_clear()` chooses again)."""
    if device_type in TRITON_DEVICE_TYPES:
        from tokenmill.workers import triton_backend  # imports triton, which only the devices that run it need

        return DeviceKernels(triton_backend.TritonAttentionBackend(), triton_backend.TRITON_OPS)
    if device_type == "cpu" and cpu_kernels_enabled():
        return DeviceKernels(CpuKernelBackend(), CPU_KERNEL_OPS)
    return DeviceKernels(TorchAttentionBackend(), TORCH_OPS)


def cpu_kernels_enabled() -> bool:
    """Whether CPU work runs the compiled kernels (built, and not turned off with TOKENMILL_CPU_KERNELS=0)."""
    return os.environ.get("TOKENMILL_CPU_KERNELS", "1") != "0" and cpu_ops.library() is not None


def runs_triton(device_type: str) -> bool:
    """Whether steps on this device type launch the Triton kernels (which compile on first use)."""
    return device_type in TRITON_DEVICE_TYPES


def attention_backend(device_type: str) -> AttentionBackend:
    return device_kernels(device_type).attention


def layer_ops(device_type: str) -> LayerOps:
    return device_kernels(device_type).ops
