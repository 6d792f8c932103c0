"""The CPU paths of the mixed-adapter LoRA delta (workers/lora/punica.py) against the float64 reference: the grouped
per-slot matmuls in use, oneDNN-packed and plain masked GEMMs over all slots, and the gather-bmm they were measured
against; base tokens get nothing."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.lora_sgmv import lora_delta_ref
from tokenmill.workers.lora.punica import (
    BSlice,
    LoRAStep,
    add_lora_gathered,
    add_lora_grouped,
    add_lora_masked,
    add_lora_packed,
)
from tokenmill.workers.models.packed_linear import can_pack, packed


@pytest.mark.parametrize(("num_tokens", "rank", "in_features", "out_features"), [(13, 8, 40, 24), (70, 64, 96, 130)])
def test_cpu_paths_match_the_float64_reference(num_tokens, rank, in_features, out_features):
    torch.manual_seed(rank)
    num_slots = 3
    x = torch.randn(num_tokens, in_features)
    a = torch.randn(num_slots, rank, in_features) / in_features**0.5
    bt = torch.randn(num_slots, rank, out_features) / rank**0.5
    token_slots = torch.randint(-1, num_slots, (num_tokens,))
    token_slots[:4] = torch.tensor([-1, 0, 1, 2])  # every slot and the base present
    step = LoRAStep(num_slots)
    step.set(token_slots, torch.float32)
    assert step.one_hot is not None
    expected = lora_delta_ref(x, a, bt, token_slots)
    outputs = {name: torch.zeros(num_tokens, out_features) for name in ("masked", "gathered", "packed", "grouped")}
    assert step.groups is not None
    add_lora_grouped(x, outputs["grouped"], a, [BSlice(bt, 0, 0)], step.groups)
    add_lora_masked(x, outputs["masked"], a, bt, step.one_hot)
    add_lora_gathered(x, outputs["gathered"], a, bt, token_slots)
    if can_pack(a):
        flat = num_slots * rank
        a_packed, b_packed = packed(a.view(flat, -1)), packed(bt.view(flat, -1).t().contiguous())
        add_lora_packed(x, outputs["packed"], a_packed, b_packed, step)
    else:
        outputs.pop("packed")
    for name, out in outputs.items():
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4, msg=name)
        assert out[token_slots < 0].eq(0).all(), name


def test_a_step_without_adapters_adds_nothing():
    step = LoRAStep(2)
    step.set(None, torch.float32)
    out = torch.ones(3, 4)
    add_lora_packed(torch.randn(3, 5), out, torch.empty(0), torch.empty(0), step)
    assert out.eq(1).all()


def _block_diagonal(num_slots: int, rank: int, widths: list[int]) -> tuple[torch.Tensor, list[BSlice]]:
    """A fused layer's B: slice i owns ranks [i * rank, (i + 1) * rank) and its own output columns."""
    bt = torch.zeros(num_slots, len(widths) * rank, sum(widths))
    pieces, first = [], 0
    for index, width in enumerate(widths):
        block = torch.randn(num_slots, rank, width) / rank**0.5
        bt[:, index * rank : (index + 1) * rank, first : first + width] = block
        pieces.append(BSlice(block, index * rank, first))
        first += width
    return bt, pieces


@pytest.mark.parametrize(
    "token_slots",
    [
        [2, 2, -1, 2, -1, 0, 2, 2, 2, 2, -1],  # uneven groups, slots 1 and 3 unused, base tokens between
        [3, 3, 3, 3, 3],  # one adapter only
        [1, 0, 3, 2, 0, 1, 2, 3],  # every slot, every token an adapter's (the decode step of the benchmark)
    ],
)
def test_grouped_path_expands_each_fused_slice_into_its_own_columns(token_slots):
    torch.manual_seed(len(token_slots))
    num_slots, rank, in_features = 4, 8, 48
    slots = torch.tensor(token_slots)
    x = torch.randn(len(slots), in_features)
    a = torch.randn(num_slots, 3 * rank, in_features) / in_features**0.5
    bt, pieces = _block_diagonal(num_slots, rank, [40, 16, 16])  # q, k, v
    step = LoRAStep(num_slots)
    step.set(slots, torch.float32)
    assert step.groups is not None
    out = torch.ones(len(slots), 72)
    add_lora_grouped(x, out, a, pieces, step.groups)
    torch.testing.assert_close((out - 1).double(), lora_delta_ref(x, a, bt, slots), atol=1e-4, rtol=1e-4)
    assert out[slots < 0].eq(1).all()


def test_a_step_of_base_tokens_only_skips_lora():
    step = LoRAStep(2)
    step.set(torch.tensor([-1, -1]), torch.float32)
    assert step.token_slots is None and step.groups is None
