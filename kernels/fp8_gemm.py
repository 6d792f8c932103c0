"""FP8 (e4m3) linear layers: `y = x @ (W * s_w).T` for a `[N, K]` float8_e4m3fn weight with a per-tensor (one
number) or per-channel (one per output row) scale `s_w`.

Three ways to run it, chosen at run time by `fp8_gemm(..., method="auto")`:
- "scaled_mm" (CUDA, compute capability >= 8.9, K and N multiples of 16): x is quantized to e4m3 (`quantize_fp8`:
  one scale per token, or the checkpoint's static per-tensor `input_scale`) and `torch._scaled_mm` multiplies the
  fp8 operands on the tensor cores into fp32; both scales are applied to that fp32 result.
- "triton" (CUDA >= 8.9 otherwise): the same W8A8 math in `_fp8_gemm_kernel` with `tl.dot` on fp8 operands.
- "triton_weight_only" (GPUs without fp8 tensor cores: compute capability < 8.9): x stays in its dtype, the kernel
  decodes each weight tile's e4m3 bits to x's dtype in registers (W8A16, as vLLM does there).
fp32 accumulation everywhere.
On CPU the worker dequantizes fp8 weights at load (they are a GPU format); `fp8_gemm_ref` is the torch reference of
every path: dequantize both operands (x after the same activation quantization, for the W8A8 paths) and multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
METHODS = ("auto", "scaled_mm", "triton", "triton_weight_only")


def quantize_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` -> (e4m3 codes `[M, K]`, float32 scales `[M, 1]`) with x ~ codes * scales.

    Dynamic: one scale per row (token), max|x| / 448. Static: the checkpoint's per-tensor `input_scale` for every row
    (values past the e4m3 range saturate).
    """
    if input_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    codes = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale.contiguous()


def weight_scale_per_row(weight_scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """float32 `[N]` scales from a per-tensor (`[]`, `[1]`) or per-channel (`[N]`, `[N, 1]`) weight scale."""
    scale = weight_scale.float().reshape(-1)
    if scale.numel() == 1:
        return scale.expand(out_features).contiguous()
    if scale.numel() != out_features:
        raise ValueError(f"fp8 weight_scale has {scale.numel()} values for {out_features} output rows")
    return scale.contiguous()


def fp8_gemm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    weight_only: bool = False,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Torch reference for `fp8_gemm`, computed in `dtype` and returned in it (float64: the exact result)."""
    w = weight.to(dtype) * weight_scale_per_row(weight_scale, weight.shape[0]).to(dtype)[:, None]
    x2 = x.reshape(-1, x.shape[-1])
    if not weight_only:
        codes, scale = quantize_fp8(x2, input_scale)
        x2 = codes.to(dtype) * scale.to(dtype)
    return (x2.to(dtype) @ w.T).reshape(*x.shape[:-1], weight.shape[0])


@triton.jit
def _e4m3_bits_to_float(bits):
    """uint8 e4m3fn bit patterns -> fp32, with integer ops only (GPUs before sm_89 have no fp8 type at all): the
    sign and the 7 exponent/mantissa bits placed in an fp16 (one more exponent bit, bias 15 instead of 7), times 2^8;
    subnormals come out right too. NaN (0x7F) is not special-cased: checkpoints hold none."""
    b = bits.to(tl.int32)
    half_bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    FP8_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x_row
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_w_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if not FP8_DOT:
            w = _e4m3_bits_to_float(w).to(x_ptr.dtype.element_ty)  # e4m3 is exact in fp16, bf16 and fp32
        if IEEE_DOT:
            acc += tl.dot(x, w, input_precision="ieee")
        elif FP8_DOT:
            # Hopper's fp8 MMA keeps only part of an fp32 mantissa while it accumulates, and Triton lets it run over
            # the whole K loop by default on sm_90 (max_num_imprecise_acc 2**30): 3e-3 off the float64 reference in
            # the second device run (2026-11-27). With 0 Triton 3.9 compiles this dot for sm_90 to mma.sync on
            # operands widened to fp16 (exact for e4m3) into fp32, as precise as torch._scaled_mm without fast
            # accumulation (the "scaled_mm" path, which takes every shape but odd K or N); 32 would keep wgmma and
            # add each 32-deep product into fp32, still ~2^-14 relative inside each (PTX read, not timed).
            acc += tl.dot(x, w, max_num_imprecise_acc=0)
        else:
            acc += tl.dot(x, w)
    acc = acc * tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if FP8_DOT:
        acc = acc * tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out_row + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def pick_method(x: torch.Tensor, out_features: int) -> str:
    """The "auto" choice for this input (see the module docstring)."""
    if not has_fp8_tensor_cores(x.device):
        return "triton_weight_only"
    if x.shape[-1] % 16 == 0 and out_features % 16 == 0:
        return "scaled_mm"
    return "triton"


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    method: str = "auto",
) -> torch.Tensor:
    """x `[..., K]` (fp16/bf16/fp32) @ (weight `[N, K]` e4m3 * weight_scale).T -> `[..., N]` in x's dtype.

    `input_scale` (a one-element tensor) quantizes activations statically, else per token; `method` is one of
    METHODS ("auto" picks by device and shape).
    """
    if method not in METHODS:
        raise ValueError(f"fp8_gemm method must be one of {METHODS}, not {method!r}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    out_shape = (*x.shape[:-1], n)
    if x2.shape[0] == 0:
        return torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if method == "auto":
        method = pick_method(x, n)
    w_scale = weight_scale_per_row(weight_scale, n)
    if method == "triton_weight_only":
        operand, x_scale = (x2 if x2.stride(-1) == 1 else x2.contiguous()), w_scale  # x_scale: unused
    else:
        operand, x_scale = quantize_fp8(x2, input_scale)
    if method == "scaled_mm":
        one = torch.ones((), dtype=torch.float32, device=x.device)
        product = torch._scaled_mm(operand, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (product * x_scale * w_scale).to(x.dtype).reshape(out_shape)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block_m = max(16, min(64, triton.next_power_of_2(x2.shape[0])))
    block_n, block_k = 64, 64
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if method == "triton_weight_only":
        weight = weight.view(torch.uint8)  # decoded in the kernel (no fp8 type before sm_89)
    _fp8_gemm_kernel[(triton.cdiv(x2.shape[0], block_m), triton.cdiv(n, block_n))](
        operand,
        x_scale,
        weight,
        w_scale,
        out,
        x2.shape[0],
        n,
        k,
        operand.stride(0),
        weight.stride(0),
        out.stride(0),
        FP8_DOT=method == "triton",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE_DOT=method == "triton_weight_only" and x.dtype == torch.float32,
    )
    return out.reshape(out_shape)
