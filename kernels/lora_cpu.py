"""The mixed-adapter LoRA update of a linear layer on the CPU in one native call (`lora_cpu.cpp`): built and loaded as
the other CPU kernels (`cpu_ops.build`: cached, private, compiled once per machine), wrapped for torch tensors.

`lora_add` adds each adapter token's (x @ A[slot].T) @ B[slot].T to the layer's output in place, for all slices of a
fused qkv / gate-up layer at once, with the tokens grouped by slot once per step (`SlotRows`). The slot weights may
be stored in a narrower dtype than the activations (`--lora-dtype bfloat16` under float32: half the bytes a step
reads, which is what the update's time goes to); it accumulates in float32 either way. It computes what
`workers/lora/punica.py`'s grouped torch path does (the tests hold both to a float64 reference), without that path's
dozen small torch ops and intermediate tensors per layer. Where the kernel cannot be built (no compiler) or
`TOKENMILL_CPU_KERNELS=0`, `library()` is None and the worker keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.kernels import cpu_ops

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lora_cpu.cpp")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_PTR, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tm_lora_add": [_I32, _I32, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64],
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded LoRA kernel, or None (logged once) where it cannot be built."""
    try:
        return cpu_ops.load(SOURCE, _SIGNATURES)
    except (RuntimeError, OSError) as exc:
        log.warning("the CPU LoRA kernel is unavailable, using the slower torch code instead: %s", exc)
        return None


def library_built_with(flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernel built with `flags` (`cpu_ops.native_flags()` under another `TOKENMILL_CPU_ISA`), loaded beside
    `library()`'s: the tests run each ISA's code on one machine. Raises as `cpu_ops.load` does."""
    return cpu_ops.load(SOURCE, _SIGNATURES, flags)


@dataclass(frozen=True)
class SlotRows:
    """A step's adapter tokens grouped by slot, once per step for every layer: slot s's tokens are
    `order[offsets[s]:offsets[s + 1]]` (int64, in token order within a slot); base-model tokens appear nowhere."""

    order: torch.Tensor  # [L] token indices, L = the step's adapter tokens
    offsets: torch.Tensor  # [S + 1]

    @staticmethod
    def of(token_slots: torch.Tensor, num_slots: int) -> SlotRows:
        """Group `token_slots [T]` (slot per token, -1: the base model) by slot."""
        counts = torch.bincount(token_slots + 1, minlength=num_slots + 1)[1:]
        offsets = torch.zeros(num_slots + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        tokens = torch.nonzero(token_slots >= 0).flatten()
        order = tokens[torch.argsort(token_slots[tokens], stable=True)]
        return SlotRows(order.contiguous(), offsets)


# The tile width of B's layout (`kTileColumns` in lora_cpu.cpp): each slice's columns in tiles of this many, each a
# contiguous [R, tile width] block, so the expand reads B front to back.
B_TILE_COLUMNS = 64


@dataclass(frozen=True)
class LoRAWeights:
    """One layer's slot weights in the kernel's layout: `a [S, n * R, in]`, and `b [S, R * out]` holding slot s's
    slice i (B transposed, scaled) at offsets [R * first_i, R * (first_i + width_i)) in tiles of `B_TILE_COLUMNS`
    columns, each tile a contiguous `[R, tile width]` block (`write_b` lays it out); `slice_columns [n + 1]` int64:
    each slice's first output column, then the layer's output size."""

    a: torch.Tensor
    b: torch.Tensor
    slice_columns: torch.Tensor
    rank: int
    out_features: int

    @staticmethod
    def of(a: torch.Tensor, slice_columns: list[int], rank: int) -> LoRAWeights:
        """The weights on slot buffers `a`, with B all zeros until `write_b`."""
        num_slots, ranks, _ = a.shape
        assert a.is_contiguous() and ranks == (len(slice_columns) - 1) * rank
        b = torch.zeros(num_slots, rank * slice_columns[-1], dtype=a.dtype, device=a.device)
        return LoRAWeights(a, b, torch.tensor(slice_columns, dtype=torch.int64), rank, slice_columns[-1])

    def write_b(self, blocks: list[torch.Tensor], slot: int | None = None) -> None:
        """Lay out each slice's `[S, R, width_i]` block of B (transposed, scaled; any strides) in the tiled `b`: all
        slots, or only `slot` (the blocks still hold every slot)."""
        rows = slice(None) if slot is None else slice(slot, slot + 1)
        columns, rank, tile = self.slice_columns.tolist(), self.rank, B_TILE_COLUMNS
        for index, block in enumerate(blocks):
            first, width = columns[index], columns[index + 1] - columns[index]
            assert block.shape[1:] == (rank, width), "one [S, R, width] block per slice"
            block, region = block[rows], self.b[rows, rank * first : rank * (first + width)]
            num_slots, full = block.shape[0], width - width % tile
            if full:
                tiles = block[:, :, :full].unflatten(2, (full // tile, tile)).transpose(1, 2)
                region[:, : rank * full].view(num_slots, full // tile, rank, tile).copy_(tiles)
            if full < width:
                region[:, rank * full :].view(num_slots, rank, width - full).copy_(block[:, :, full:])


def enabled() -> bool:
    """Whether the worker runs the kernel: built, and the CPU kernels not turned off (`TOKENMILL_CPU_KERNELS=0`)."""
    return os.environ.get("TOKENMILL_CPU_KERNELS", "1") != "0" and library() is not None


def supports(x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights) -> bool:
    """Whether `lora_add` runs these tensors (CPU, output rows with unit stride, x and out of one dtype it knows, the
    weights of one dtype it knows: the same as the activations' or not, as `--lora-dtype` made them)."""
    return (
        x.device.type == "cpu"
        and x.dtype == out.dtype
        and x.dtype in DTYPE_CODES
        and weights.a.dtype in DTYPE_CODES
        and out.stride(-1) == 1
    )


def lora_add(x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights, rows: SlotRows) -> None:
    """out [T, out] += (x [T, in] @ a[slot].T) @ B[slot].T for each adapter token of `rows`, in place; the base
    model's tokens are left as they are. Call only where `enabled()` and `supports(x, out, weights)`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_slots, _, in_features = weights.a.shape
    assert x.shape[1] == in_features and out.shape[0] == x.shape[0] and out.stride(-1) == 1
    assert out.shape[1] == weights.out_features and rows.offsets.shape[0] == num_slots + 1
    status = library().tm_lora_add(  # type: ignore[union-attr]
        DTYPE_CODES[x.dtype],
        DTYPE_CODES[weights.a.dtype],
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        out.stride(0),
        weights.a.data_ptr(),
        weights.b.data_ptr(),
        in_features,
        weights.out_features,
        weights.rank,
        weights.slice_columns.data_ptr(),
        weights.slice_columns.shape[0] - 1,
        rows.order.data_ptr(),
        rows.offsets.data_ptr(),
        num_slots,
    )
    if status != 0:
        raise ValueError(f"lora_add: unsupported dtypes {x.dtype} (activations), {weights.a.dtype} (weights)")
