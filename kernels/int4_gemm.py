"""Weight-only int4 GEMM for AWQ and GPTQ checkpoints: `y = x @ dequant(W)`, dequantized in registers.

W is the `[K, N]` (in, out) matrix of a linear layer, stored as 4-bit codes `q`, per-group zero points `z` and
per-group scales `s`: `W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]`, with `g(k) = k // group_size`, or
`g_idx[k]` for a GPTQ act-order (desc_act) checkpoint. Eight codes share an int32, lowest nibble first.

- AWQ (AutoAWQ's GEMM layout): qweight `[K, N/8]` packed along N, nibble `j` holding column `AWQ_ORDER[j]` of the
  eight (`[0, 2, 4, 6, 1, 3, 5, 7]`); qzeros `[K/G, N/8]` packed the same way; scales `[K/G, N]`. A checkpoint
  quantized without zero points (`zero_point: false`) has no qzeros: the codes are offset by 8.
- GPTQ: qweight `[K/8, N]` packed along K (nibble `j` of row `r` is input row `8r + j`); qzeros `[K/G, N/8]`
  packed along N in plain order; scales `[K/G, N]`; optional g_idx `[K]`. GPTQ v1 checkpoints (AutoGPTQ, GPTQModel
  by default) store each zero point minus one (`zero_offset=1`); the v2 format stores it as is (`zero_offset=0`).
  Without qzeros (compressed-tensors' symmetric pack-quantized weights, mapped onto this layout) codes are offset by 8.

`awq_gemm` and `gptq_gemm` launch one program per (BLOCK_M rows, BLOCK_N columns) tile, walk K in BLOCK_K steps,
unpack and dequantize the weight tile in fp32, cast it to x's dtype and accumulate `tl.dot` in fp32 (IEEE for fp32
activations). When BLOCK_K divides the group size (and there is no g_idx) a tile lies in one group and reads one row
of scales and zeros; otherwise they are gathered per element. `awq_gemm_ref` / `gptq_gemm_ref` and the
`*_dequantize_ref` functions are the torch references; `pack_int4` / `unpack_int4` are shared with the quantized
weight classes (`workers/quantization/`) and the test quantizer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a packed AWQ int32 holds column AWQ_ORDER[j] of its eight
PLAIN_ORDER = tuple(range(8))


# ---------------------------------------------------------------- packing (torch)


def pack_int4(codes: torch.Tensor, dim: int, order: tuple[int, ...] = PLAIN_ORDER) -> torch.Tensor:
    """Pack 4-bit codes (integers 0..15) eight to an int32 along `dim` (whose size must be a multiple of 8)."""
    dim = dim % codes.dim()
    if codes.shape[dim] % 8:
        raise ValueError(f"cannot pack {codes.shape[dim]} int4 codes along dim {dim}: not a multiple of 8")
    moved = codes.movedim(dim, -1).to(torch.int64)
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // 8, 8)[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    packed = ((grouped & 0xF) << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the int32 bit pattern
    return packed.movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = PLAIN_ORDER) -> torch.Tensor:
    """The inverse of `pack_int4`: int32 `packed` -> int8 codes 0..15, eight times longer along `dim`."""
    dim = dim % packed.dim()
    moved = packed.movedim(dim, -1).to(torch.int64)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    nibbles = (moved[..., None] >> shifts) & 0xF  # [..., C, 8]: nibble j
    inverse = [order.index(column) for column in range(8)]  # column c lives in nibble inverse[c]
    codes = nibbles[..., inverse].reshape(*moved.shape[:-1], moved.shape[-1] * 8)
    return codes.to(torch.int8).movedim(-1, dim).contiguous()


# ---------------------------------------------------------------- references (torch)


def awq_dequantize_ref(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The dense `[K, N]` matrix of an AWQ weight, in `dtype` (see the module docstring)."""
    codes = unpack_int4(qweight, 1, AWQ_ORDER).to(dtype)
    group_size = group_size if group_size > 0 else codes.shape[0]
    if qzeros is None:
        zeros = torch.full_like(scales, 8, dtype=dtype)
    else:
        zeros = unpack_int4(qzeros, 1, AWQ_ORDER).to(dtype)
    groups = torch.arange(codes.shape[0], device=codes.device) // group_size
    return (codes - zeros[groups]) * scales.to(dtype)[groups]


def gptq_dequantize_ref(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    zero_offset: int = 1,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The dense `[K, N]` matrix of a GPTQ weight, in `dtype` (see the module docstring)."""
    codes = unpack_int4(qweight, 0).to(dtype)
    if qzeros is None:
        zeros = torch.full_like(scales, 8, dtype=dtype)
    else:
        zeros = unpack_int4(qzeros, 1).to(dtype) + zero_offset
    if g_idx is not None:
        groups = g_idx.long()
    else:
        group_size = group_size if group_size > 0 else codes.shape[0]
        groups = torch.arange(codes.shape[0], device=codes.device) // group_size
    return (codes - zeros[groups]) * scales.to(dtype)[groups]


def awq_gemm_ref(x, qweight, qzeros, scales, group_size) -> torch.Tensor:
    """Torch reference for `awq_gemm`, in x's dtype (pass float64 x for an exact reference)."""
    return x @ awq_dequantize_ref(qweight, qzeros, scales, group_size, x.dtype)


def gptq_gemm_ref(x, qweight, qzeros, scales, group_size, g_idx=None, zero_offset=1) -> torch.Tensor:
    """Torch reference for `gptq_gemm`, in x's dtype (pass float64 x for an exact reference)."""
    return x @ gptq_dequantize_ref(qweight, qzeros, scales, group_size, g_idx, zero_offset, x.dtype)


# ---------------------------------------------------------------- the kernel


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    g_idx_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    stride_x_row,
    stride_out_row,
    AWQ: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    GROUP_PER_TILE: tl.constexpr,
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
    packed_cols = N // 8
    if AWQ:
        col_shift = ((cols % 2) * 4 + (cols % 8) // 2) * 4  # column c sits in nibble AWQ_ORDER.index(c % 8)
    else:
        col_shift = (cols % 8) * 4
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w_mask = k_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if AWQ:
            packed = tl.load(qweight_ptr + ks[:, None] * packed_cols + (cols // 8)[None, :], mask=w_mask, other=0)
            codes = (packed >> col_shift[None, :]) & 0xF
        else:
            packed = tl.load(qweight_ptr + (ks // 8)[:, None] * N + cols[None, :], mask=w_mask, other=0)
            codes = (packed >> ((ks % 8) * 4)[:, None]) & 0xF
        if GROUP_PER_TILE:
            group = k_start // group_size
            scales = tl.load(scales_ptr + group * N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_ZEROS:
                packed_zeros = tl.load(qzeros_ptr + group * packed_cols + cols // 8, mask=col_mask, other=0)
                zeros = (((packed_zeros >> col_shift) & 0xF) + ZERO_OFFSET).to(tl.float32)[None, :]
            else:
                zeros = 8.0
        else:
            if HAS_G_IDX:
                groups = tl.load(g_idx_ptr + ks, mask=k_mask, other=0)
            else:
                groups = ks // group_size
            scales = tl.load(scales_ptr + groups[:, None] * N + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                packed_zeros = tl.load(
                    qzeros_ptr + groups[:, None] * packed_cols + (cols // 8)[None, :], mask=w_mask, other=0
                )
                zeros = (((packed_zeros >> col_shift[None, :]) & 0xF) + ZERO_OFFSET).to(tl.float32)
            else:
                zeros = 8.0
        w = ((codes.to(tl.float32) - zeros) * scales).to(x_ptr.dtype.element_ty)  # [BLOCK_K, BLOCK_N]
        if IEEE_DOT:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out_row + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def tile_shape(num_rows: int, group_size: int, has_g_idx: bool) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_PER_TILE) for `num_rows` rows of x."""
    block_m = max(16, min(64, triton.next_power_of_2(max(num_rows, 1))))
    block_k = next((size for size in (64, 32, 16) if group_size % size == 0), 64)
    return block_m, 64, block_k, not has_g_idx and group_size % block_k == 0


def _int4_gemm(x, qweight, qzeros, scales, g_idx, group_size, n, awq, zero_offset) -> torch.Tensor:
    k = x.shape[-1]
    group_size = group_size if group_size > 0 else k
    if g_idx is None and k % group_size:  # with g_idx (act-order) the groups are looked up, any K works
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k, group_per_tile = tile_shape(x2.shape[0], group_size, g_idx is not None)
    grid = (triton.cdiv(x2.shape[0], block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x2,
        qweight.contiguous(),
        qzeros.contiguous() if qzeros is not None else qweight,
        scales.contiguous(),
        g_idx.to(torch.int32).contiguous() if g_idx is not None else qweight,
        out,
        x2.shape[0],
        n,
        k,
        group_size,
        x2.stride(0),
        out.stride(0),
        AWQ=awq,
        HAS_ZEROS=qzeros is not None,
        HAS_G_IDX=g_idx is not None,
        ZERO_OFFSET=zero_offset,
        GROUP_PER_TILE=group_per_tile,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE_DOT=x.dtype == torch.float32,
    )
    return out.reshape(*x.shape[:-1], n)


def awq_gemm(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x `[..., K]` (fp16/bf16/fp32) @ the AWQ weight -> `[..., N]` in x's dtype; group_size -1 is one group."""
    return _int4_gemm(x, qweight, qzeros, scales, None, group_size, scales.shape[1], True, 0)


def gptq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    zero_offset: int = 1,
) -> torch.Tensor:
    """x `[..., K]` (fp16/bf16/fp32) @ the GPTQ weight -> `[..., N]` in x's dtype; g_idx for act-order."""
    return _int4_gemm(x, qweight, qzeros, scales, g_idx, group_size, scales.shape[1], False, zero_offset)
