"""The one interface every quantized weight format implements.

A `QuantizedWeight` stands in for a linear layer's dense `[out_features, in_features]` weight parameter. It keeps its
data as buffers (so `.to()`, the model's byte count and `state_dict` see it) and does its own matmul. The layers slice
it as they slice a dense weight: `rows` for column-parallel shards and for placing q/k/v (gate/up) in a fused layer,
`cols` for row-parallel shards. `concat_rows` fuses parts into one weight when their formats allow it; `StackedRows`
runs them one after the other when they do not (a GGUF Q4_K_M file stores some of a layer's projections as Q6_K).
"""

from __future__ import annotations

import torch
from torch import nn


class QuantizedWeight(nn.Module):
    """A quantized `[out_features, in_features]` weight; subclasses hold the data and implement the methods below."""

    format: str = ""  # "gguf", "awq", "gptq", "fp8", ...

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def numel(self) -> int:
        """Elements of the dense weight this stands for (what a loader counts as filled)."""
        return self.out_features * self.in_features

    def nbytes(self) -> int:
        """Bytes this weight holds (its buffers)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., in_features]` -> `[..., out_features]` in x's dtype (no bias)."""
        raise NotImplementedError

    def matmul_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out[:] = matmul(x)` for x `[T, in_features]` into out `[T, out_features]` (x's dtype; rows may be strided,
        as a column slice of a wider output). A format whose kernel writes there directly overrides this copy."""
        out.copy_(self.matmul(x))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense `[out_features, in_features]` weight (the reference the kernels are tested against)."""
        raise NotImplementedError

    def pack_for_matmul(self) -> None:
        """Reorder the data in place for this machine's matmul kernel, once loading is done (a no-op unless the
        format has such a layout: GGUF's repacking). Every method keeps working on the result."""

    def rows(self, start: int, count: int) -> QuantizedWeight:
        """Output rows [start, start + count)."""
        raise NotImplementedError

    def cols(self, start: int, count: int) -> QuantizedWeight:
        """Input columns [start, start + count); ValueError when they do not fall on the format's group boundaries."""
        raise NotImplementedError

    @classmethod
    def concat_rows(cls, parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """One weight whose rows are the parts' rows in order, or None when these parts cannot be fused."""
        return None


class StackedRows(QuantizedWeight):
    """Parts that cannot be fused into one weight (different formats or block types), run one after the other."""

    format = "stacked"

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        super().__init__(sum(part.out_features for part in parts), parts[0].in_features)
        if any(part.in_features != self.in_features for part in parts):
            raise ValueError("stacked quantized weights must share in_features")
        self.parts = nn.ModuleList(parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # each part writes its columns of one output (no torch.cat: a recorded CPU decode step replays only the
        # kernels' calls, and GGUF's write in place)
        flat = x.reshape(-1, self.in_features)
        out = torch.empty((flat.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        first = 0
        for part in self.parts:
            part.matmul_into(flat, out[:, first : first + part.out_features])
            first += part.out_features
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([part.dequantize(dtype) for part in self.parts], dim=0)


def fuse_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The parts as one weight: fused by their format when it can, else stacked."""
    if len(parts) == 1:
        return parts[0]
    if len({type(part) for part in parts}) == 1:
        fused = type(parts[0]).concat_rows(parts)
        if fused is not None:
            return fused
    return StackedRows(parts)
