"""A linear layer's LoRA slots on the device, and attaching them to a model's q/k/v/o and gate/up/down layers.

Each LoRA-able layer gets `a [S, n * R, in]` and `bt [S, n * R, out]` (S = max_loras slots, R = max_lora_rank, n the
checkpoint tensors fused in the layer: 3 for qkv, 2 for gate/up, else 1). Slice i of a fused layer owns ranks
[i * R, i * R + r) of A and, in B, only its own output rows, so the fused layer's update is one low-rank product
whose B is block-diagonal (the CUDA path's layout; the CPU paths expand each slice's own block).
Tensor parallelism shards the pair like its base layer: a column-parallel layer keeps B's rows of this rank's
outputs (its heads, its MLP columns), a row-parallel one A's columns of this rank's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import lora_cpu
from tokenmill.kernels.lora_cpu import LoRAWeights
from tokenmill.workers.lora.adapter import LoRAAdapter, LoRAPair
from tokenmill.workers.lora.punica import BSlice, LoRAStep, add_lora, add_lora_grouped
from tokenmill.workers.models.layers import GateUpLinear, OutputSlice, QKVLinear, RowParallelLinear
from tokenmill.workers.models.llama import PagedCausalLM
from tokenmill.workers.models.pipeline import MissingLayer

# the PEFT projection name of each fused layer's shard ids
_PEFT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj"}
_BASE_FORWARDS = (QKVLinear.forward, GateUpLinear.forward)


@dataclass(frozen=True)
class LoRASlice:
    """Where one PEFT projection's A and B land in a layer's slot buffers."""

    projection: str  # PEFT's name: q_proj, ..., down_proj
    out: OutputSlice  # its output rows (B's rows): this rank's share of the full tensor
    in_first: int  # its input columns (A's columns): this rank's share of the full tensor
    in_count: int


class LoRALinearSlots:
    """One linear layer's slot buffers; `add_to` is the layer's `LoRADelta`."""

    def __init__(
        self, layer: int, slices: list[LoRASlice], out_features: int, num_slots: int, max_rank: int, step: LoRAStep
    ) -> None:
        self.layer = layer
        self.slices = slices
        self.max_rank = max_rank
        self.step = step
        ranks = len(slices) * max_rank
        in_count = slices[0].in_count
        # on the current default device and dtype (the slots': the model's, or --lora-dtype's)
        self.a = torch.zeros(num_slots, ranks, in_count)
        self.bt = torch.zeros(num_slots, ranks, out_features)
        # The CPU paths' B, each slice's own ranks and output columns (not the block-diagonal), rewritten at each
        # load: the native kernel's tiled copy (`kernel_weights.b`) and, built on first use where the kernel cannot
        # run a call, the torch path's per-slice blocks (`_grouped_b`). CUDA reads the block-diagonal bt.
        self.kernel_weights = None if self.bt.is_cuda else self._kernel_weights()
        self._grouped_b: list[BSlice] | None = None

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        step = self.step
        if step.token_slots is None:
            return
        rows = step.rows
        if rows is not None and self.kernel_weights is not None and lora_cpu.supports(x, out, self.kernel_weights):
            lora_cpu.lora_add(x, out, self.kernel_weights, rows)
        elif step.groups is not None:
            add_lora_grouped(x, out, self.a, self._grouped_slices(), step.groups)
        else:
            add_lora(x, out, self.a, self.bt, step)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter`'s updates of this layer into `slot` (zeros where it has none)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        for index, piece in enumerate(self.slices):
            pair = adapter.pairs.get((self.layer, piece.projection))
            if pair is not None:
                self._write_pair(slot, index * self.max_rank, piece, pair, adapter)
        if self.kernel_weights is not None:
            self.kernel_weights.write_b(self._slice_blocks(), slot)
        self._grouped_b = None

    def _slice_blocks(self) -> list[torch.Tensor]:
        """Each slice's own block of the block-diagonal bt, `[S, R, columns]` views."""
        rank = self.max_rank
        return [
            self.bt[:, index * rank : (index + 1) * rank].narrow(2, piece.out.dest_row, piece.out.rows)
            for index, piece in enumerate(self.slices)
        ]

    def _grouped_slices(self) -> list[BSlice]:
        """The torch path's B: each slice's block copied out of bt once after each load."""
        if self._grouped_b is None:
            blocks = self._slice_blocks()
            self._grouped_b = [
                BSlice(block.contiguous(), index * self.max_rank, piece.out.dest_row)
                for index, (block, piece) in enumerate(zip(blocks, self.slices, strict=True))
            ]
        return self._grouped_b

    def _kernel_weights(self) -> LoRAWeights | None:
        """The native kernel's view of the slots, or None where the slices do not tile the output in order."""
        columns = [0]
        for piece in self.slices:
            if piece.out.dest_row != columns[-1]:
                return None
            columns.append(columns[-1] + piece.out.rows)
        if columns[-1] != self.bt.shape[2]:
            return None
        return LoRAWeights.of(self.a, columns, self.max_rank)

    def _write_pair(self, slot: int, first_rank: int, piece: LoRASlice, pair: LoRAPair, adapter: LoRAAdapter) -> None:
        rank = pair.a.shape[0]
        out = piece.out
        if pair.a.shape[1] < piece.in_first + piece.in_count or pair.b.shape[0] < out.src_row + out.rows:
            raise ValueError(
                f"LoRA adapter {adapter.request.lora_name!r}: layer {self.layer} {piece.projection} has lora_A "
                f"{tuple(pair.a.shape)} and lora_B {tuple(pair.b.shape)}, which do not fit the model's projection"
            )
        a = pair.a.narrow(1, piece.in_first, piece.in_count)
        b = pair.b.narrow(0, out.src_row, out.rows)
        self.a[slot, first_rank : first_rank + rank].copy_(a)
        self.bt[slot, first_rank : first_rank + rank, out.dest_row : out.dest_row + out.rows].copy_(b.t())


def attach_lora_slots(model: PagedCausalLM, num_slots: int, max_rank: int, step: LoRAStep) -> list[LoRALinearSlots]:
    """Give every LoRA-able linear layer of `model`'s decoder layers (this stage's) its slots; returns them all.

    Call it under the model's default device and the slots' dtype. A layer that computes its own output differently
    from its base class (Gemma's GELU gate/up) gets none: an adapter that targets it is refused at load."""
    attached = []
    for index, layer in enumerate(model.get_submodule("model.layers").children()):
        if isinstance(layer, MissingLayer):
            continue
        for name, module in layer.named_modules():
            projection = name.rpartition(".")[2]
            if isinstance(module, (QKVLinear, GateUpLinear)) and type(module).forward in _BASE_FORWARDS:
                slices = [_column_slice(piece, module.weight.shape[1]) for piece in module.output_slices()]
                attached.append(_attach(module, index, slices, num_slots, max_rank, step))
            elif isinstance(module, RowParallelLinear) and projection in ("o_proj", "down_proj"):
                out = OutputSlice(projection, 0, 0, module.weight.shape[0])
                piece = LoRASlice(projection, out, module.first_input_column, module.rank_input_size)
                attached.append(_attach(module, index, [piece], num_slots, max_rank, step))
    return attached


def _column_slice(piece: OutputSlice, in_features: int) -> LoRASlice:
    return LoRASlice(_PEFT_NAMES[piece.shard_id], piece, 0, in_features)


def _attach(
    module: QKVLinear | GateUpLinear | RowParallelLinear,
    layer: int,
    slices: list[LoRASlice],
    num_slots: int,
    max_rank: int,
    step: LoRAStep,
) -> LoRALinearSlots:
    slots = LoRALinearSlots(layer, slices, module.weight.shape[0], num_slots, max_rank, step)
    module.lora = slots
    return slots
