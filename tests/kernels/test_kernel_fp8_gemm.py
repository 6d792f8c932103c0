"""The FP8 GEMM's Triton paths against a float64 reference: W8A8 (activations quantized per token, or with a static
per-tensor input scale) and weight-only, per-tensor and per-channel weight scales, odd shapes, batches 1..64.
(`torch._scaled_mm` needs an sm_89+ GPU: `test_scaled_mm_matches_triton` runs only there.)"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.quantized_checkpoints import quantize_fp8_weight
from tokenmill.kernels.fp8_gemm import FP8_MAX, fp8_gemm, fp8_gemm_ref, has_fp8_tensor_cores, pick_method, quantize_fp8

TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cases are built on the CPU, the kernel runs here
# the W8A8 Triton path needs fp8 tensor cores (sm_89+) on a GPU; the interpreter runs it anywhere
W8A8_RUNS_HERE = DEVICE == "cpu" or has_fp8_tensor_cores(torch.device(DEVICE))


def make_case(n, k, rows, dtype, per_channel, seed):
    """(quantized weight, x), on DEVICE."""
    with torch.device("cpu"):
        g = torch.Generator().manual_seed(seed)
        weight = torch.randn(n, k, generator=g, dtype=torch.float64) / k**0.5
        weight[: n // 2] *= 8  # rows of different magnitude: per-channel scales differ
        q = quantize_fp8_weight(weight, per_channel)
        x = torch.randn(rows, k, generator=g, dtype=torch.float64).to(dtype)
    return type(q)(q.weight.to(DEVICE), q.weight_scale.to(DEVICE)), x.to(DEVICE)


@pytest.mark.parametrize(
    "n, k, rows, dtype, per_channel, static",
    [
        (200, 136, 1, torch.float16, True, False),  # decode; N, K not multiples of the 64 tile
        (72, 96, 33, torch.bfloat16, False, False),
        (64, 200, 64, torch.float32, True, True),  # a static input scale
        (40, 64, 5, torch.float16, False, True),
    ],
)
@pytest.mark.skipif(not W8A8_RUNS_HERE, reason="W8A8 needs fp8 tensor cores (sm_89+) on a GPU")
def test_w8a8_triton_matches_float64_reference(n, k, rows, dtype, per_channel, static):
    q, x = make_case(n, k, rows, dtype, per_channel, seed=n + rows)
    input_scale = torch.tensor([x.double().abs().max().item() / FP8_MAX * 0.8]) if static else None  # some saturate
    got = fp8_gemm(x, q.weight, q.weight_scale, input_scale, method="triton").double().cpu()
    codes, scale = quantize_fp8(x, input_scale)
    dense = q.dense().cpu()
    expected = (codes.double() * scale.double()).cpu() @ dense.T  # the quantized input times the quantized weight
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(
        fp8_gemm_ref(x, q.weight, q.weight_scale, input_scale).cpu(), expected, rtol=1e-12, atol=1e-12
    )
    # activation quantization costs e4m3's precision, no more: close to the exact product of x
    exact = x.double().cpu() @ dense.T
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()


@pytest.mark.parametrize(
    "n, k, rows, dtype, per_channel",
    [(200, 136, 3, torch.float16, True), (72, 96, 17, torch.bfloat16, False), (48, 80, 1, torch.float32, True)],
)
def test_weight_only_triton_matches_float64_reference(n, k, rows, dtype, per_channel):
    """The path of GPUs without fp8 tensor cores: it decodes e4m3 bits itself (subnormals included)."""
    q, x = make_case(n, k, rows, dtype, per_channel, seed=k + rows)
    got = fp8_gemm(x, q.weight, q.weight_scale, method="triton_weight_only")
    expected = x.double().cpu() @ q.dense().cpu().T
    torch.testing.assert_close(got.double().cpu(), expected, **TOLERANCES[dtype])
    torch.testing.assert_close(fp8_gemm_ref(x, q.weight, q.weight_scale, weight_only=True).cpu(), expected)


def test_weight_only_decodes_every_e4m3_value():
    """All 254 finite e4m3 codes (NaN excluded) as one row of weights, times one-hot inputs."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # 0x7F / 0xFF are NaN
    weight = codes.reshape(-1, 2)  # [127, 2]
    eye = torch.eye(2, dtype=torch.float32)
    got = fp8_gemm(eye, weight, torch.ones(1), method="triton_weight_only")
    torch.testing.assert_close(got.T, weight.float(), rtol=0, atol=0)


def test_method_choice_and_bad_input():
    x = torch.randn(3, 32)
    assert pick_method(x, 64) == ("scaled_mm" if has_fp8_tensor_cores(x.device) else "triton_weight_only")
    q, _ = make_case(64, 32, 1, torch.float32, True, seed=0)
    with pytest.raises(ValueError, match="method must be one of"):
        fp8_gemm(x, q.weight, q.weight_scale, method="cutlass")
    with pytest.raises(ValueError, match="weight_scale has 3 values for 64 output rows"):
        fp8_gemm(x, q.weight, torch.ones(3), method="triton_weight_only")
    assert fp8_gemm(x[:0], q.weight, q.weight_scale, method="triton").shape == (0, 64)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not has_fp8_tensor_cores(torch.device("cuda")),
    reason="torch._scaled_mm needs an sm_89+ GPU",
)
def test_scaled_mm_matches_triton():
    q, x = make_case(256, 128, 24, torch.bfloat16, True, seed=3)
    torch.testing.assert_close(
        fp8_gemm(x, q.weight, q.weight_scale, method="scaled_mm").float(),
        fp8_gemm(x, q.weight, q.weight_scale, method="triton").float(),
        atol=6e-2,
        rtol=6e-2,
    )
