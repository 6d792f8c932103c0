"""The per-row CPU kernels (`kernels/row_ops.py`) against what they replace: the `gguf` package's dequantizer and
torch's argmax, bit for bit; and the GGUF embedding lookup that uses the first."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants

from tests.helpers.gguf_kernels import Q, random_blocks
from tokenmill.kernels import gguf_ops, row_ops

needs_row_kernels = pytest.mark.skipif(row_ops.library() is None, reason="no C++ compiler here")


@needs_row_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_dequantize_rows_is_the_gguf_reference(qtype):
    blocks = random_blocks(qtype, 5, 576, np.random.default_rng(int(qtype)))
    rows = row_ops.dequantize_rows(torch.from_numpy(blocks), int(qtype), 576)
    assert rows is not None and rows.dtype == torch.float32 and rows.shape == (5, 576)
    expected = gguf_quants.dequantize(blocks, qtype).astype(np.float32)
    np.testing.assert_array_equal(rows.numpy().view(np.uint32), expected.view(np.uint32))  # signed zeros too


@needs_row_kernels
def test_half_scales_of_every_kind_convert_exactly():
    """Subnormal, zero, negative zero, infinite and NaN scales give what numpy's float16 conversion gives."""
    halves = np.array([1e-7, 6e-5, 0.0, -0.0, -2.5, 65504.0, np.inf, -np.inf, np.nan], dtype=np.float16)
    blocks = random_blocks(Q.Q8_0, len(halves), 32, np.random.default_rng(0))
    blocks[:, :2] = halves[:, None].view(np.uint8)
    rows = row_ops.dequantize_rows(torch.from_numpy(blocks), int(Q.Q8_0), 32)
    assert rows is not None
    expected = gguf_quants.dequantize(blocks, Q.Q8_0).astype(np.float32)
    np.testing.assert_array_equal(rows.numpy(), expected)  # NaN where NaN


def test_types_and_shapes_it_does_not_take_are_left_to_the_caller():
    blocks = torch.from_numpy(random_blocks(Q.Q6_K, 2, 256, np.random.default_rng(1)))
    assert row_ops.dequantize_rows(blocks, int(Q.Q6_K), 256) is None
    assert row_ops.argmax_rows(torch.zeros(2, 8, dtype=torch.float64)) is None
    assert row_ops.argmax_rows(torch.zeros(8, 2).t()) is None  # columns not contiguous


@needs_row_kernels
def test_gguf_dequantize_rows_uses_the_kernel_with_the_same_bits():
    """`gguf_ops.dequantize_rows` (embedding lookups, weights dequantized at load) of a repacked Q8_0 table."""
    blocks = random_blocks(Q.Q8_0, 16, 576, np.random.default_rng(2))
    repacked = gguf_ops.repack_rows(torch.from_numpy(blocks), int(Q.Q8_0), 16, 576)
    table = gguf_ops.dequantize_rows(repacked, int(Q.Q8_0), 16, 576, repacked=True)
    np.testing.assert_array_equal(table.numpy(), gguf_quants.dequantize(blocks, Q.Q8_0))


@needs_row_kernels
@pytest.mark.parametrize("width", [1, 7, 8, 9, 49152])
def test_argmax_is_torchs(width):
    logits = torch.randn(3, width, generator=torch.Generator().manual_seed(width))
    logits[1, width // 2] = logits[1].max() + 1  # a clear winner in one row
    logits[2] = logits[2].round()  # ties: the first of equal maxima
    assert row_ops.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert row_ops.argmax_rows(logits[1:2]).tolist() == [logits[1].argmax().item()]


@needs_row_kernels
def test_argmax_of_nan_and_infinite_rows_is_torchs():
    rows = torch.tensor(
        [
            [1.0, float("nan"), 5.0, float("nan"), 2.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [float("-inf")] * 10,
            [-0.0, 0.0, -0.0, 0.0, -1.0, -1.0, -1.0, -1.0, -1.0, float("inf")],
            [0.0] * 9 + [float("nan")],
        ]
    )
    assert row_ops.argmax_rows(rows).tolist() == rows.argmax(dim=-1).tolist()


@needs_row_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_added_in_place_is_torchs_sum(dtype):
    out = torch.randn(3, 1152).to(dtype)
    out[0, :4] = torch.tensor([float("nan"), float("inf"), -3.0e38, 1e-40])  # NaN, overflow, a subnormal
    bias = torch.randn(1152).to(dtype)
    bias[4] = float("-inf")
    expected = out + bias
    assert row_ops.add_bias_(out, bias)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@needs_row_kernels
def test_bias_goes_into_strided_rows_and_leaves_the_rest():
    wide = torch.randn(4, 100)
    out, bias = wide[:, 10:30], torch.randn(20)
    before = wide.clone()
    expected = out + bias
    assert row_ops.add_bias_(out, bias)
    assert torch.equal(out, expected)
    assert torch.equal(wide[:, :10], before[:, :10]) and torch.equal(wide[:, 30:], before[:, 30:])
    one_row = torch.randn(1, 2, 8)  # batched rows, contiguous
    expected = one_row + bias[:8]
    assert row_ops.add_bias_(one_row, bias[:8].contiguous()) and torch.equal(one_row, expected)


@needs_row_kernels
def test_bias_it_does_not_take_is_left_to_the_caller():
    out = torch.randn(2, 8)
    before = out.clone()
    assert not row_ops.add_bias_(out, torch.randn(8, dtype=torch.float64))  # another dtype
    assert not row_ops.add_bias_(out, torch.randn(4))  # another width
    assert not row_ops.add_bias_(out.t(), torch.randn(2))  # column-strided rows
    assert not row_ops.add_bias_(torch.randn(2, 8, dtype=torch.float16), torch.randn(8, dtype=torch.float16))
    assert not row_ops.add_bias_(torch.randn(2, 3, 8).transpose(0, 1), torch.randn(8))  # not one 2-D array
    assert torch.equal(out, before)


@needs_row_kernels
def test_the_race_samples_each_token_with_its_softmax_probability():
    # 200k rows, one key each: a 1e-4 token's share and a -inf token's zero are what the race must get right
    probs = torch.tensor([0.7, 0.2999, 0.0001, 0.0])
    draws = 200_000
    keys = torch.randint(-(1 << 62), 1 << 62, (draws,), generator=torch.Generator().manual_seed(1))
    tokens = row_ops.race_rows(probs.log().repeat(draws, 1), keys)
    assert tokens is not None
    shares = torch.bincount(tokens, minlength=4).double() / draws
    assert shares[0].item() == pytest.approx(0.7, abs=0.005)
    assert shares[1].item() == pytest.approx(0.2999, abs=0.005)
    assert 0.4e-4 < shares[2].item() < 1.8e-4
    assert shares[3].item() == 0.0


@needs_row_kernels
def test_the_race_is_uniform_over_equal_logits_of_a_large_vocabulary():
    vocab, draws = 49_152, 64
    keys = torch.arange(draws, dtype=torch.int64) * 7919
    tokens = row_ops.race_rows(torch.zeros(draws, vocab), keys)
    assert tokens is not None
    assert len(set(tokens.tolist())) > draws - 4  # distinct keys draw (almost always) distinct tokens
    # tokens from all over the vocabulary, not from its first chunk only
    assert tokens.min().item() < vocab // 4 and tokens.max().item() > 3 * vocab // 4


@needs_row_kernels
def test_a_rows_token_depends_on_its_key_and_logits_alone():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(2)) * 3
    keys = torch.tensor([5, -5, 1 << 40, -(1 << 62), 12345, 5], dtype=torch.int64)
    together = row_ops.race_rows(logits, keys)
    assert together is not None
    alone = [row_ops.race_rows(logits[i : i + 1], keys[i : i + 1]) for i in range(6)]
    assert together.tolist() == [int(t.item()) for t in alone]
    assert together.tolist() != row_ops.race_rows(logits, keys + 1).tolist()  # another key, other draws


@needs_row_kernels
def test_the_race_leaves_what_it_does_not_take_to_the_caller():
    keys = torch.zeros(2, dtype=torch.int64)
    assert row_ops.race_rows(torch.zeros(2, 8, dtype=torch.float64), keys) is None
    assert row_ops.race_rows(torch.zeros(8, 2).t(), keys) is None  # column stride 8
    assert row_ops.race_rows(torch.zeros(2, 8), keys[:1]) is None
