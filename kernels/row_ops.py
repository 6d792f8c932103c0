"""Per-row CPU kernels at a decode step's two ends (`row_ops.cpp`): GGUF embedding rows dequantized, greedy argmax;
a quantized linear layer's bias added in place (torch's `out + bias` is an operation a recorded CPU decode step,
`workers/cpu_graphs.py`, cannot replay, so Qwen2's q/k/v bias kept its decode steps eager); and the sampler's
exponential race over a row's scaled logits with hashed noise (`race_rows`: torch's noise tensor, softmax and divide
cost ~0.7 ms a sampled row a step over a 49k vocabulary).

Built and loaded as the other CPU kernels (`cpu_ops.load`: cached, private, compiled once per machine). Each wrapper
returns None where the kernel does not take its arguments (no compiler, `TOKENMILL_CPU_KERNELS=0`, a GGUF type it
does not know, a tensor off the CPU), and the caller keeps its own code: the `gguf` package's numpy dequantizer,
torch's argmax, torch's race. The first three give those same results, bit for bit (tests/kernels/test_row_ops.py);
the race draws other noise of the same distribution.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from tokenmill.kernels import cpu_ops

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_ops.cpp")
# ggml's ids of the types `tm_dequantize_rows` knows: Q4_0, Q4_1, Q8_0 (32 values per block)
DEQUANTIZE_TYPES = frozenset({2, 3, 8})
BLOCK_VALUES = 32

_PTR, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tm_dequantize_rows": [_I32, _PTR, _I64, _I64, _PTR],
    "tm_argmax_rows": [_PTR, _I64, _I64, _I64, _PTR],
    "tm_add_bias_rows": [_I32, _PTR, _I64, _I64, _I64, _PTR],
    "tm_race_rows": [_PTR, _I64, _I64, _I64, _PTR, _PTR],
}
_BIAS_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (logged once) where they cannot be built or the CPU kernels are off."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return None
    try:
        return cpu_ops.load(SOURCE, _SIGNATURES)
    except (RuntimeError, OSError) as exc:
        log.warning("the CPU row kernels are unavailable, using numpy and torch instead: %s", exc)
        return None


def dequantizes(qtype: int) -> bool:
    """Whether `dequantize_rows` runs the kernel for blocks of `qtype` (rows a multiple of 32 wide)."""
    return qtype in DEQUANTIZE_TYPES and library() is not None


def dequantize_rows(rows: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor | None:
    """float32 `[n, in_features]` from `rows` (`[n, row bytes]` uint8, plain GGUF blocks of `qtype`); None where the
    kernel does not take them."""
    lib = library()
    if not dequantizes(qtype) or lib is None or in_features % BLOCK_VALUES or rows.dim() != 2:
        return None
    rows = rows.contiguous()
    out = torch.empty((rows.shape[0], in_features), dtype=torch.float32)
    if lib.tm_dequantize_rows(qtype, rows.data_ptr(), rows.shape[0], in_features, out.data_ptr()) != 0:
        return None
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """int64 `[rows]`: each row's argmax as `torch.argmax(dim=-1)` gives it (a NaN wins; the first of equal maxima);
    None where the kernel does not take `logits` (not a 2-D float32 CPU tensor with unit column stride)."""
    lib = library()
    if lib is None or logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_cpu:
        return None
    if logits.shape[1] == 0 or logits.stride(1) != 1:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    status = lib.tm_argmax_rows(
        logits.data_ptr(), logits.shape[0], logits.shape[1], _row_stride(logits), out.data_ptr()
    )
    return out if status == 0 else None


def add_bias_(out: torch.Tensor, bias: torch.Tensor) -> bool:
    """`out += bias` in place over out's last dimension, as torch's `out + bias` gives it bit for bit; False (out
    untouched) where the kernel does not take them: not CPU tensors of one dtype (float32 or bfloat16), bias not 1-D
    contiguous of out's last size, out's rows not one 2-D array with unit column stride."""
    dtype = _BIAS_DTYPES.get(out.dtype)
    if dtype is None or bias.dtype != out.dtype or not (out.is_cpu and bias.is_cpu):
        return False
    lib = library()
    if lib is None:
        return False
    if bias.dim() != 1 or not bias.is_contiguous() or out.dim() == 0 or bias.shape[0] != out.shape[-1]:
        return False
    if out.dim() == 2:
        rows = out
    elif out.is_contiguous():
        rows = out.view(-1, out.shape[-1])
    else:
        return False
    if rows.stride(1) != 1:
        return False
    row_stride = _row_stride(rows)
    return lib.tm_add_bias_rows(dtype, rows.data_ptr(), rows.shape[0], rows.shape[1], row_stride, bias.data_ptr()) == 0


def race_rows(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """int64 `[rows]`: each row's token by the exponential race over `scaled` (`[rows, vocab]` float32 logits with
    temperature and filters applied), its noise drawn from a hash of the row's key (`keys`: `[rows]` int64, read as
    64-bit patterns) and the token id; None where the kernel does not take them (not CPU float32 rows with unit
    column stride)."""
    lib = library()
    if lib is None or scaled.dim() != 2 or scaled.dtype != torch.float32 or not scaled.is_cpu:
        return None
    if scaled.shape[1] == 0 or scaled.stride(1) != 1 or keys.shape != (scaled.shape[0],) or keys.dtype != torch.int64:
        return None
    keys = keys.contiguous()
    out = torch.empty(scaled.shape[0], dtype=torch.int64)
    status = lib.tm_race_rows(
        scaled.data_ptr(), scaled.shape[0], scaled.shape[1], _row_stride(scaled), keys.data_ptr(), out.data_ptr()
    )
    return out if status == 0 else None


def _row_stride(rows: torch.Tensor) -> int:
    """The stride between the rows of a 2-D tensor as the kernels read it: a lone row's stride may be anything."""
    return rows.stride(0) if rows.shape[0] > 1 else rows.shape[1]
