"""The mixed-adapter LoRA kernels (shrink + expand) against the float64 reference: slots mixed within a block of
tokens, base tokens left alone, ranks 8 and 64 (a rank-64 slot block spans several rank tiles), odd sizes."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.lora_sgmv import lora_delta_ref, lora_expand, lora_shrink


def _slots(num_tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    """Rows grouped by request as a step's are (runs of one slot, -1 for base requests), plus a few lone tokens."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(seed)
    runs = []
    while sum(len(run) for run in runs) < num_tokens:
        length = int(torch.randint(1, 9, (1,), generator=generator))
        slot = int(torch.randint(-1, num_slots, (1,), generator=generator))
        runs.append([slot] * length)
    return torch.tensor([slot for run in runs for slot in run][:num_tokens], dtype=torch.long)


@pytest.mark.parametrize(
    ("num_tokens", "in_features", "out_features", "rank", "num_slots"),
    [(37, 96, 72, 8, 3), (21, 130, 200, 64, 2), (5, 64, 48, 24, 4), (1, 40, 33, 8, 1)],
)
def test_shrink_expand_match_float64_reference(num_tokens, in_features, out_features, rank, num_slots):
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, in_features)
    a = torch.randn(num_slots, rank, in_features) / in_features**0.5
    bt = torch.randn(num_slots, rank, out_features) / rank**0.5
    token_slots = _slots(num_tokens, num_slots, seed=rank)
    base = torch.randn(num_tokens, out_features)
    out = base.clone()
    lora_expand(lora_shrink(x, a, token_slots), bt, token_slots, out)
    expected = base.double() + lora_delta_ref(x, a, bt, token_slots)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    base_rows = token_slots < 0
    assert torch.equal(out[base_rows], base[base_rows])  # base tokens untouched, bit for bit
    assert (token_slots >= 0).any() and base_rows.any() or num_tokens < 5


def test_shrink_is_zero_for_base_tokens_and_reads_each_tokens_own_slot():
    x = torch.ones(3, 16)
    a = torch.stack([torch.full((8, 16), 1.0), torch.full((8, 16), 2.0)])
    shrunk = lora_shrink(x, a, torch.tensor([1, -1, 0]))
    assert shrunk[0].eq(32.0).all() and shrunk[1].eq(0.0).all() and shrunk[2].eq(16.0).all()


def test_expand_adds_in_the_outputs_dtype_onto_a_strided_view():
    """qkv's output is one matmul whose rows the kernel updates in place; a half-precision output sums in float32."""
    x = torch.randn(9, 32)
    a, bt = torch.randn(2, 8, 32), torch.randn(2, 8, 24)
    token_slots = torch.tensor([0, 0, 1, 1, -1, 0, 1, -1, 0])
    wide = torch.zeros(9, 40, dtype=torch.float16)
    out = wide[:, :24]  # rows 40 apart
    lora_expand(lora_shrink(x, a, token_slots), bt, token_slots, out)
    expected = lora_delta_ref(x, a, bt, token_slots).half()
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-3)
    assert wide[:, 24:].eq(0).all()
