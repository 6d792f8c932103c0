"""GGUF (llama.cpp) block-quantized weights kept as their raw blocks: `GGUFWeight`.

A GGUF tensor of a block type stores each output row as `in_features / block_size` blocks of `type_size` bytes
(e.g. Q4_1: 32 weights in 20 bytes), so a weight is a uint8 `[out_features, row_bytes]` array. Rows are independent:
slicing, permuting and concatenating rows is exact and cheap. Columns can be cut only on block boundaries.

The matmul and the row dequantization run the compiled CPU kernels of `kernels/gguf_ops.py` (the types in its
SUPPORTED_TYPES); on CUDA the loader dequantizes GGUF weights instead (there are no GPU GGUF kernels).

Once loaded, `pack_for_matmul` may reorder the blocks of a weight of a 32-wide type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
IQ4_NL) in place into the kernels' repacked layout (8 rows interleaved, `gguf_ops.repack_rows`; same bytes, same
shape), and `repacked` says so. Every method
reads either layout: `lookup` and `dequantize` gather the plain rows back, and `rows` / `cols` / `permute_rows` /
`concat_rows` return plain weights (they run while loading, before the repacking).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from tokenmill.workers.quantization.base import QuantizedWeight

if TYPE_CHECKING:
    from tokenmill.kernels import gguf_ops


@functools.cache
def _ops():
    from tokenmill.kernels import gguf_ops

    return gguf_ops


def supported_types() -> frozenset[int]:
    """The GGML types whose weights stay quantized (the CPU kernels' types)."""
    return _ops().SUPPORTED_TYPES


def block_shape(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML type."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    return block_size, type_size


class GGUFWeight(QuantizedWeight):
    """A weight of one GGML block type: `blocks` uint8 `[out_features, in_features / block_size * type_size]`."""

    format = "gguf"

    def __init__(
        self, blocks: torch.Tensor, qtype: int, out_features: int, in_features: int, repacked: bool = False
    ) -> None:
        super().__init__(out_features, in_features)
        self.qtype = int(qtype)
        self.block_size, self.type_size = block_shape(self.qtype)
        row_bytes = in_features // self.block_size * self.type_size
        if (
            in_features % self.block_size
            or blocks.dtype != torch.uint8
            or tuple(blocks.shape) != (out_features, row_bytes)
        ):
            raise ValueError(
                f"GGUF {self.type_name} weight [{out_features}, {in_features}] needs uint8 blocks "
                f"[{out_features}, {row_bytes}], got {blocks.dtype} {tuple(blocks.shape)}"
            )
        self.register_buffer("blocks", blocks.contiguous())
        self.repacked = bool(repacked)  # `blocks` in gguf_ops.repack_rows' layout, not the file's
        self._int8_matmul: tuple = ()  # (blocks, repacked, gguf_ops.int8_matmul_on(...)) for the blocks it checked
        if self.repacked and self.qtype not in _ops().REPACK_TYPES:
            raise ValueError(f"GGUF {self.type_name} weights have no repacked layout")

    @property
    def type_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.qtype).name

    def extra_repr(self) -> str:
        return f"{self.type_name}, out_features={self.out_features}, in_features={self.in_features}" + (
            ", repacked" if self.repacked else ""
        )

    def pack_for_matmul(self) -> None:
        """Repack the blocks in place for the matmul kernel where `gguf_ops.repack_wanted` says it pays (idempotent:
        a tied embedding and LM head share this weight)."""
        if not self.repacked and _ops().repack_wanted(self.qtype, self.out_features):
            self.blocks = _ops().repack_rows(self.blocks, self.qtype, self.out_features, self.in_features)
            self.repacked = True
            self._int8_matmul = ()  # it held the plain blocks

    def plain_blocks(self) -> torch.Tensor:
        """The blocks in the file's layout (a copy when repacked)."""
        if not self.repacked:
            return self.blocks
        return _ops().unpack_rows(self.blocks, self.qtype, self.out_features, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        kernel = self._int8_kernel()
        if kernel is not None:
            return kernel(flat).view(*x.shape[:-1], self.out_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = _ops().gguf_matmul(
            flat, self.blocks, self.qtype, self.out_features, self.in_features, repacked=self.repacked
        )
        return out.view(*x.shape[:-1], self.out_features)

    def matmul_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The int8 kernel writes straight into `out` (a column slice of a stacked layer's output) where it runs."""
        kernel = self._int8_kernel()
        if kernel is None:
            out.copy_(self.matmul(x))
        else:
            kernel(x, out)

    def _int8_kernel(self) -> gguf_ops.Int8Matmul | None:
        """The int8 matmul on the current blocks (checked once per blocks), or None in float mode or without the
        kernels."""
        ops = _ops()
        if ops.DEFAULT_ACTIVATIONS != "int8":
            return None
        cached = self._int8_matmul
        if not cached or cached[0] is not self.blocks or cached[1] != self.repacked:
            cached = self._int8_matmul = (
                self.blocks,
                self.repacked,
                ops.int8_matmul_on(
                    self.blocks, self.qtype, self.out_features, self.in_features, repacked=self.repacked
                ),
            )
        return cached[2]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (
            _ops()
            .dequantize_rows(self.blocks, self.qtype, self.out_features, self.in_features, repacked=self.repacked)
            .to(dtype)
        )

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dense rows `ids` `[T]` -> `[T, in_features]` in `dtype`, dequantizing only those rows (an
        embedding table's lookup)."""
        selected = _ops().gather_rows(self.blocks, self.qtype, self.in_features, ids, repacked=self.repacked)
        rows = _ops().dequantize_rows(selected, self.qtype, selected.shape[0], self.in_features)
        return rows.to(dtype).view(*ids.shape, self.in_features)

    def lookup_is_native(self) -> bool:
        """Whether `lookup` is compiled kernel calls alone (row gather and dequantization), none of it numpy: what a
        recorded CPU decode step (`workers/cpu_graphs.py`) can replay."""
        from tokenmill.kernels import row_ops

        in_whole_blocks = self.in_features % row_ops.BLOCK_VALUES == 0
        gathered_natively = self.repacked and _ops().library() is not None  # plain blocks: torch's index_select
        return gathered_natively and in_whole_blocks and row_ops.dequantizes(self.qtype)

    def rows(self, start: int, count: int) -> GGUFWeight:
        if start < 0 or count < 0 or start + count > self.out_features:
            raise ValueError(f"rows [{start}, {start + count}) out of range for {self.out_features} rows")
        if start == 0 and count == self.out_features:
            return self
        # a copy, so a rank's slice does not keep the whole checkpoint tensor alive
        if self.repacked:
            return GGUFWeight(
                _ops().gather_rows(
                    self.blocks, self.qtype, self.in_features, torch.arange(start, start + count), repacked=True
                ),
                self.qtype,
                count,
                self.in_features,
            )
        return GGUFWeight(self.blocks[start : start + count].clone(), self.qtype, count, self.in_features)

    def permute_rows(self, order: torch.Tensor) -> GGUFWeight:
        """Row i of the result is row `order[i]` of this weight (exact: rows are independent)."""
        return GGUFWeight(self.plain_blocks()[order], self.qtype, self.out_features, self.in_features)

    def cols(self, start: int, count: int) -> GGUFWeight:
        if start < 0 or count <= 0 or start + count > self.in_features:
            raise ValueError(f"columns [{start}, {start + count}) out of range for {self.in_features} columns")
        if start % self.block_size or count % self.block_size:
            raise ValueError(
                f"GGUF {self.type_name} weights can only be split on {self.block_size}-column block "
                f"boundaries, not at columns [{start}, {start + count})"
            )
        if start == 0 and count == self.in_features:
            return self
        first, end = start // self.block_size * self.type_size, (start + count) // self.block_size * self.type_size
        return GGUFWeight(self.plain_blocks()[:, first:end].contiguous(), self.qtype, self.out_features, count)

    @classmethod
    def concat_rows(cls, parts: list[GGUFWeight]) -> GGUFWeight | None:
        """One weight when every part has the same block type and width; None (stack them) otherwise, as a Q4_K_M
        file's Q4_K and Q6_K projections of one layer."""
        first = parts[0]
        if any(part.qtype != first.qtype or part.in_features != first.in_features for part in parts):
            return None
        blocks = torch.cat([part.plain_blocks() for part in parts], dim=0)
        return cls(blocks, first.qtype, blocks.shape[0], first.in_features)
