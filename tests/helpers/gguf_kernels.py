"""GGUF CPU kernel checks shared by the kernel tests: random quantized blocks, comparisons with the torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from tokenmill.kernels import gguf_ops

Q = GGMLQuantizationType
needs_kernels = pytest.mark.skipif(gguf_ops.library() is None, reason="no C++ compiler here (the fallback is tested)")

# byte offsets of each block type's fp16 scales: (offset, low, high) for a uniform draw
_SCALES = {
    Q.Q4_0: [(0, -0.02, 0.02)],
    Q.Q8_0: [(0, -0.02, 0.02)],
    Q.Q4_1: [(0, 0.0, 0.02), (2, -0.15, 0.0)],
    Q.Q5_0: [(0, -0.01, 0.01)],
    Q.Q5_1: [(0, 0.0, 0.01), (2, -0.15, 0.0)],
    Q.IQ4_NL: [(0, -0.001, 0.001)],
    Q.Q2_K: [(80, 0.0, 0.01), (82, 0.0, 0.01)],
    Q.Q3_K: [(108, -0.003, 0.003)],
    Q.Q4_K: [(0, 0.0, 0.003), (2, 0.0, 0.003)],
    Q.Q5_K: [(0, 0.0, 0.002), (2, 0.0, 0.003)],
    Q.Q6_K: [(208, -0.002, 0.002)],
}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks: every quant, scale byte and bit random, the fp16 scales finite and moderate."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block_elems, block_bytes), dtype=np.uint8)
    for offset, low, high in _SCALES[qtype]:
        halves = rng.uniform(low, high, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, offset : offset + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def quantized_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' int8 activations, dequantized (float64), and each value's block max|x|. The SIMD versions are
    compiled with fused multiply-adds, so they round the exact product x * inverse (float64 holds it exactly), the
    portable one its float32 rounding: they differ where that product lies within a rounding of a half."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    fused = gguf_ops.isa() in ("avx2", "avx512", "neon")
    q = np.rint(xb.astype(np.float64) * inverse.astype(np.float64) if fused else xb * inverse)
    scale = (amax / np.float32(127)).astype(np.float32)
    return (q * scale.astype(np.float64)).reshape(x.shape), np.broadcast_to(amax, xb.shape).reshape(x.shape)


def check(x: torch.Tensor, blocks: np.ndarray, qtype: GGMLQuantizationType, y: torch.Tensor) -> None:
    n, k = blocks.shape[0], x.shape[1]
    w = gguf_quants.dequantize(blocks, qtype).astype(np.float64).reshape(n, k)
    x64 = x.double().numpy()
    xq, amax = quantized_activations(x.float().numpy(), GGML_QUANT_SIZES[qtype][0])
    got = y.double().numpy()
    magnitude = np.abs(xq) @ (2 * np.abs(w) + np.abs(w).max(axis=1, keepdims=True)).T
    np.testing.assert_array_less(
        np.abs(got - xq @ w.T), 1e-6 * magnitude + 1e-30, err_msg=f"{qtype.name}: not the int8-activation result"
    )
    bound = (amax / 254) @ np.abs(w).T
    np.testing.assert_array_less(
        np.abs(got - x64 @ w.T),
        bound * (1 + 1e-4) + 1e-5 * magnitude,
        err_msg=f"{qtype.name}: off the exact product by more than the int8 rounding",
    )


def check_float(x: torch.Tensor, blocks: np.ndarray, qtype: GGMLQuantizationType, y: torch.Tensor) -> None:
    n, k = blocks.shape[0], x.shape[1]
    w = gguf_quants.dequantize(blocks, qtype).astype(np.float64).reshape(n, k)
    x64 = x.double().numpy()
    magnitude = np.abs(x64) @ np.abs(w).T
    np.testing.assert_array_less(
        np.abs(y.double().numpy() - x64 @ w.T),
        2e-6 * magnitude + 1e-30,
        err_msg=f"{qtype.name}: float activations off the float64 product",
    )
