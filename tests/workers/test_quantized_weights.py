"""AWQWeight, GPTQWeight and FP8Weight as the layers use them: slices (rows for column-parallel shards and fused
q/k/v, cols for row-parallel shards) and fusion give the slices and concatenations of the dense weight; the CPU
matmul is a matmul by it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.quantized_checkpoints import awq_tensors, gptq_tensors, quantize_fp8_weight, quantize_int4
from tokenmill.workers.quantization.awq import AWQWeight
from tokenmill.workers.quantization.base import StackedRows, fuse_rows
from tokenmill.workers.quantization.fp8 import FP8Weight
from tokenmill.workers.quantization.gptq import GPTQWeight

N, K, GROUP = 48, 128, 32


def make(kind: str, seed: int = 0, group_size: int = GROUP, rows: int = N):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, K, generator=g, dtype=torch.float64) / K**0.5
    if kind == "fp8":
        q = quantize_fp8_weight(dense, per_channel=seed % 2 == 0)
        return FP8Weight(q.weight, q.weight_scale), q.dense()
    act_order = kind == "gptq-act-order"
    q = quantize_int4(dense, group_size, perm=torch.randperm(K, generator=g) if act_order else None, min_zero=1)
    if kind == "awq":
        t = awq_tensors(q)
        return AWQWeight(t["qweight"], t["qzeros"], t["scales"], group_size), q.dense()
    t = gptq_tensors(q)
    return GPTQWeight(t["qweight"], t["qzeros"], t["scales"], group_size, t["g_idx"] if act_order else None), q.dense()


KINDS = ["awq", "gptq", "gptq-act-order", "fp8"]


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_rows_cols_and_matmul(kind):
    weight, dense = make(kind)
    assert weight.shape == (N, K) and weight.numel() == N * K
    torch.testing.assert_close(weight.dequantize(torch.float64), dense, rtol=0, atol=1e-12)
    for start, count in [(0, 16), (8, 24), (40, 8)]:
        torch.testing.assert_close(
            weight.rows(start, count).dequantize(torch.float64), dense[start : start + count], rtol=0, atol=1e-12
        )
    torch.testing.assert_close(weight.cols(64, 64).dequantize(torch.float64), dense[:, 64:], rtol=0, atol=1e-12)
    x = torch.randn(5, K, dtype=torch.float64)
    torch.testing.assert_close(weight.matmul(x), x @ dense.T)
    assert weight.rows(0, 16).nbytes() < weight.nbytes()


@pytest.mark.parametrize("kind", KINDS)
def test_concat_rows_fuses_parts_of_one_format(kind):
    (a, dense_a), (b, dense_b) = make(kind, seed=1, rows=32), make(kind, seed=2, rows=16)
    if kind == "gptq-act-order":  # q/k/v share an input, so GPTQ gives them one g_idx
        b = GPTQWeight(b.qweight, b.qzeros, b.scales, GROUP, a.g_idx)
        dense_b = b.dequantize(torch.float64)
    fused = fuse_rows([a, b])
    assert type(fused) is type(a) and fused.shape == (48, K)
    torch.testing.assert_close(fused.dequantize(torch.float64), torch.cat([dense_a, dense_b]), rtol=0, atol=1e-12)
    # act-order: the shared g_idx is kept once; FP8: a's per-tensor scale became 32 per-row ones
    extra = {"gptq-act-order": -4 * K, "fp8": 4 * 31}.get(kind, 0)
    assert fused.nbytes() == a.nbytes() + b.nbytes() + extra


def test_parts_that_cannot_fuse_are_stacked():
    awq, _ = make("awq")
    other_groups, _ = make("awq", group_size=64)
    assert isinstance(fuse_rows([awq, other_groups]), StackedRows)
    plain, _ = make("gptq")
    shuffled, _ = make("gptq-act-order")
    assert isinstance(fuse_rows([plain, shuffled]), StackedRows)
    fp8, _ = make("fp8")
    assert isinstance(fuse_rows([awq, fp8]), StackedRows)


def test_slices_off_the_layout_are_value_errors():
    awq, _ = make("awq")
    with pytest.raises(ValueError, match="group boundaries"):
        awq.cols(16, 64)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        awq.rows(0, 12)
    gptq, _ = make("gptq")
    with pytest.raises(ValueError, match="8-row"):
        gptq.cols(4, 64)
    shuffled, dense = make("gptq-act-order")  # act-order keeps every group: any 8-aligned column range works
    torch.testing.assert_close(shuffled.cols(8, 40).dequantize(torch.float64), dense[:, 8:48], rtol=0, atol=1e-12)


def test_fp8_static_input_scales_fuse_to_the_largest():
    a = FP8Weight(*quantize_fp8_weight(torch.randn(16, 32), True), input_scale=torch.tensor(0.5))
    b = FP8Weight(*quantize_fp8_weight(torch.randn(8, 32), False), input_scale=torch.tensor(2.0))
    fused = FP8Weight.concat_rows([a, b])
    assert fused.per_channel and float(fused.input_scale) == 2.0
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
