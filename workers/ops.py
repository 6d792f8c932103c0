"""The kernels model layers call, behind one small interface: RMSNorm (with the residual add), rotary, SiLU-and-mul.

`workers/backends.py` picks a device's `LayerOps`: the Triton kernels on CUDA, the compiled CPU kernels on CPU. An
entry left None means the layer runs its own torch code (`workers/models/layers.py`), which is also the reference
every kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerOps:
    # rms_norm(x [T, H], weight, eps, residual | None) -> (norm(x + residual), x + residual)
    rms_norm: Callable | None = None
    # rotary(q [T, Hq, D], k [T, Hkv, D], positions [T], cos_sin_table) -> (q, k), rotated in place
    rotary: Callable | None = None
    # silu_and_mul(x [T, 2 * I]) -> silu(x[:, :I]) * x[:, I:]
    silu_and_mul: Callable | None = None
    # moe_experts(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, k], topk_weights [T, k]) -> [T, H]
    moe_experts: Callable | None = None


TORCH_OPS = LayerOps()
