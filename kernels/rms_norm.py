"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

`rms_norm(x, w, eps, residual)` returns `(out, residual_out)`:
- without a residual: `out = x / rms(x) * w` and `residual_out = x` (the next layer's residual);
- with one: `s = x + residual` (rounded to x's dtype, as an unfused add would be), `out = s / rms(s) * w`,
  `residual_out = s` (as vLLM's fused_add_rms_norm).
The math is in fp32; one program normalizes one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    stride_x_row,
    stride_residual_row,
    stride_out_row,
    stride_residual_out_row,
    HIDDEN: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HIDDEN)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out_row + cols, x, mask=mask)
    x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / HIDDEN
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = x * tl.rsqrt(mean_square + eps) * weight
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize each row of `x[T, H]` (after adding `residual`, if given); see the module docstring."""
    num_rows, hidden = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        residual_out = x
    else:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out, residual_out
    x = _rows(x)
    residual_in = _rows(residual) if residual is not None else x
    _rms_norm_kernel[(num_rows,)](
        x,
        residual_in,
        weight,
        out,
        residual_out,
        eps,
        x.stride(0),
        residual_in.stride(0),
        out.stride(0),
        residual_out.stride(0),
        HIDDEN=hidden,
        BLOCK_HIDDEN=triton.next_power_of_2(hidden),
        HAS_RESIDUAL=residual is not None,
    )
    return out, residual_out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference for `rms_norm`."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), x
