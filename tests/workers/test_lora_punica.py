"""The CPU paths of the mixed-adapter LoRA delta (workers/lora/punica.py) against the float64 reference: oneDNN-packed
and plain masked GEMMs over all slots, and the gather-bmm they were measured against; base tokens get nothing."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.lora_sgmv import lora_delta_ref
from tokenmill.workers.lora.punica import LoRAStep, add_lora_gathered, add_lora_masked, add_lora_packed
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
    outputs = {name: torch.zeros(num_tokens, out_features) for name in ("masked", "gathered", "packed")}
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
