"""FP8 (e4m3) weights (`quant_method: "fp8"`, and compressed-tensors' FP8 schemes): `FP8Weight` and the reader.

A layer stores `weight` float8_e4m3fn `[out, in]`, `weight_scale` (one float32, or one per output row) and, with
static activation scales (`activation_scheme: "static"`), `input_scale` (one float32); the dense weight is
`weight * weight_scale`. On CUDA `matmul` runs `kernels/fp8_gemm.fp8_gemm` (torch._scaled_mm or Triton, W8A8 on
fp8 tensor cores, weight-only before sm_89); elsewhere it multiplies by the dequantized weight (no activation
quantization). Block-scaled FP8 (`weight_block_size`, DeepSeek-style) is not supported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from tokenmill.config import ModelConfig
from tokenmill.kernels.fp8_gemm import FP8_DTYPE, weight_scale_per_row
from tokenmill.workers.model_loader import safetensors_files
from tokenmill.workers.quantization.base import QuantizedWeight
from tokenmill.workers.quantization.checkpoint import iter_grouped_tensors, quantization_config

log = logging.getLogger(__name__)


class FP8Weight(QuantizedWeight):
    format = "fp8"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None = None):
        super().__init__(*weight.shape)
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"FP8 weight has dtype {weight.dtype}, expected {FP8_DTYPE}")
        scale = weight_scale.float().reshape(-1)
        if scale.numel() not in (1, self.out_features):
            raise ValueError(
                f"FP8 weight_scale has {scale.numel()} values for a [{self.out_features}, "
                f"{self.in_features}] weight (expected 1 or {self.out_features})"
            )
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", scale.contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.numel() > 1

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tokenmill.kernels.fp8_gemm import fp8_gemm

            return fp8_gemm(x, self.weight, self.weight_scale, self.input_scale)
        return x @ self.dequantize(x.dtype).T

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        scale = weight_scale_per_row(self.weight_scale, self.out_features).to(compute)
        return (self.weight.to(compute) * scale[:, None]).to(dtype)

    def rows(self, start: int, count: int) -> FP8Weight:
        scale = self.weight_scale[start : start + count] if self.per_channel else self.weight_scale
        return FP8Weight(self.weight[start : start + count], scale, self.input_scale)

    def cols(self, start: int, count: int) -> FP8Weight:
        return FP8Weight(self.weight[:, start : start + count], self.weight_scale, self.input_scale)

    @classmethod
    def concat_rows(cls, parts: list[FP8Weight]) -> FP8Weight | None:
        first = parts[0]
        if any(
            p.in_features != first.in_features or (p.input_scale is None) != (first.input_scale is None) for p in parts
        ):
            return None
        if not any(p.per_channel for p in parts) and all(
            torch.equal(p.weight_scale, first.weight_scale) for p in parts
        ):
            scale = first.weight_scale
        else:  # per-tensor scales become per-row ones: the same dense weight
            scale = torch.cat([weight_scale_per_row(p.weight_scale, p.out_features) for p in parts])
        # one GEMM quantizes its input once: with static scales it takes the largest, as vLLM does
        input_scale = None if first.input_scale is None else torch.stack([p.input_scale for p in parts]).amax()
        return FP8Weight(torch.cat([p.weight for p in parts]), scale, input_scale)


def fp8_settings(config: dict) -> bool:
    """Whether activations use the checkpoint's static `input_scale` (True) or are quantized per token (False)."""
    if config.get("weight_block_size"):
        raise ValueError(
            f"block-scaled FP8 checkpoints (quantization_config.weight_block_size="
            f"{config['weight_block_size']}) are not supported"
        )
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"FP8 quantization_config.activation_scheme={scheme!r}: expected 'dynamic' or 'static'")
    return scheme == "static"


def fp8_items(path: str, static_input: bool) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The tensors of an FP8 checkpoint with each layer's weight/weight_scale(/input_scale) as one FP8Weight named
    `<prefix>.weight`; everything else passes through, dense layers and KV-cache scales (`self_attn.k_scale`, read
    by the model for an fp8 KV cache) alike."""
    parts = ("weight", "weight_scale", "input_scale")
    for name, item in iter_grouped_tensors(safetensors_files(path), parts, marker="weight_scale"):
        if isinstance(item, dict):
            input_scale = item.get("input_scale") if static_input else None
            if static_input and input_scale is None:
                raise ValueError(f"{name}: activation_scheme is 'static' but the checkpoint has no input_scale")
            yield f"{name}.weight", FP8Weight(item["weight"], item["weight_scale"], input_scale)
        else:
            yield name, item


def read_fp8(model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with its FP8 layers as `FP8Weight`s (see `fp8_items`)."""
    yield from fp8_items(model_cfg.path, fp8_settings(quantization_config(model_cfg.path)))
