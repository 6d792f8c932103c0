"""RMSNorm (plain and fused with the residual add) against its reference and torch's own rms_norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import rms_norm as rms_norm_module
from tokenmill.kernels.rms_norm import rms_norm, rms_norm_ref

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [576, 80])
def test_rms_norm_matches_reference(hidden, with_residual, dtype):
    x = torch.randn(7, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    residual = torch.randn(7, hidden).to(dtype) if with_residual else None
    out, residual_out = rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    assert out.dtype == dtype and residual_out.dtype == dtype
    torch.testing.assert_close(out, ref_out, **TOLERANCES[dtype])
    torch.testing.assert_close(residual_out, ref_residual, atol=0, rtol=0)  # the sum rounds the same way


def test_reference_is_torch_rms_norm():
    x, weight = torch.randn(4, 64), torch.randn(64)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-6)[0], F.rms_norm(x, (64,), weight, eps=1e-6))


def test_fused_add_returns_the_sum_as_new_residual():
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.ones(64)
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, F.rms_norm(x + residual, (64,), weight, eps=1e-6), atol=1e-5, rtol=1e-5)
    _, passthrough = rms_norm(x, weight, 1e-6)
    assert passthrough is x  # without a residual, x becomes the next residual


def test_strided_rows():
    wide = torch.randn(5, 200)
    x = wide[:, 10:138]  # rows 200 apart
    weight = torch.randn(128)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6)[0], rms_norm_ref(x, weight, 1e-6)[0], atol=1e-5, rtol=1e-5)


def test_empty_and_single_row(monkeypatch):
    weight = torch.randn(64)
    x = torch.randn(1, 64)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6)[0], rms_norm_ref(x, weight, 1e-6)[0])

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("an empty batch must not launch a kernel")

    monkeypatch.setattr(rms_norm_module, "_rms_norm_kernel", NoLaunch())
    out, residual_out = rms_norm(torch.empty(0, 64), weight, 1e-6, torch.empty(0, 64))
    assert out.shape == (0, 64) and residual_out.shape == (0, 64)
