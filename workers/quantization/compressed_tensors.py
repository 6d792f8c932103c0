"""compressed-tensors checkpoints (llm-compressor, `quant_method: "compressed-tensors"`): the two schemes that map
onto this package's weights.

- `pack-quantized` int4 weights (W4A16): `weight_packed` int32 `[out, in/8]` (signed codes + 8, packed along the
  input dim, lowest nibble first), `weight_scale` `[out, in/G]` (`[out, 1]` for the channel strategy),
  `weight_zero_point` int32 `[out/8, in/G]` packed along the output dim when asymmetric, `weight_g_idx` `[in]` for
  group act-order, `weight_shape`. Transposed, that is GPTQ's layout with v2 zero points (zero 8 when symmetric):
  a `GPTQWeight`.
- `float-quantized` FP8 (W8A8-FP8, FP8_DYNAMIC): `weight` e4m3 `[out, in]`, `weight_scale` `[1]` or `[out, 1]`,
  `input_scale` with static activation scales: an `FP8Weight` (`fp8.py`).

Layers in `ignore` are stored dense and pass through. Each layer's scheme is the config group whose `targets` match
it ("Linear", a layer name, or "re:<regex>"); other schemes (int8, 2:4 sparsity, block-scaled FP8) are a clear error.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from tokenmill.config import ModelConfig
from tokenmill.kernels.int4_gemm import pack_int4, unpack_int4
from tokenmill.workers.model_loader import safetensors_files
from tokenmill.workers.quantization.base import QuantizedWeight
from tokenmill.workers.quantization.checkpoint import iter_grouped_tensors, quantization_config
from tokenmill.workers.quantization.fp8 import FP8Weight
from tokenmill.workers.quantization.gptq import GPTQWeight, is_plain_g_idx

PARTS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "input_scale")


def _targets_match(targets: list[str], prefix: str) -> bool:
    for target in targets:
        if target == "Linear" or prefix == target or prefix.endswith(f".{target}"):
            return True
        if target.startswith("re:") and re.match(target[3:], prefix):
            return True
    return False


def scheme_for(config: dict, prefix: str) -> dict:
    """The config group (`weights`, `input_activations`, ...) that quantized layer `prefix`."""
    groups = config.get("config_groups") or {}
    for group in groups.values():
        if _targets_match(group.get("targets", []), prefix):
            return group
    raise ValueError(f"compressed-tensors: no config group of quantization_config targets {prefix!r}")


def int4_weight(prefix: str, tensors: dict[str, torch.Tensor], scheme: dict) -> GPTQWeight:
    weights = scheme.get("weights") or {}
    if weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
        raise ValueError(
            f"compressed-tensors {prefix}: {weights.get('type')} weights of {weights.get('num_bits')} "
            f"bits: only 4-bit int (pack-quantized) and FP8 (float-quantized) are supported"
        )
    packed = tensors["weight_packed"]
    out_features, in_features = packed.shape[0], packed.shape[1] * 8
    if "weight_shape" in tensors and tuple(tensors["weight_shape"].tolist()) != (out_features, in_features):
        raise ValueError(
            f"compressed-tensors {prefix}: weight_shape {tensors['weight_shape'].tolist()} is not a "
            f"multiple of 8 along the input dim (padded packing is not supported)"
        )
    scales = tensors["weight_scale"]  # [out, groups]
    group_size = in_features // scales.shape[1]
    zeros = None
    if "weight_zero_point" in tensors:  # codes of the zero points, packed along the output dim
        zeros = pack_int4(unpack_int4(tensors["weight_zero_point"], 0)[:out_features].T, 1)
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None and is_plain_g_idx(g_idx, group_size):
        g_idx = None
    return GPTQWeight(packed.T.contiguous(), zeros, scales.T.contiguous(), group_size, g_idx, zero_offset=0)


def fp8_weight(prefix: str, tensors: dict[str, torch.Tensor], scheme: dict) -> FP8Weight:
    weights = scheme.get("weights") or {}
    if weights.get("strategy", "tensor") not in ("tensor", "channel"):
        raise ValueError(
            f"compressed-tensors {prefix}: FP8 weights with strategy {weights['strategy']!r} are not "
            f"supported (tensor or channel)"
        )
    activations = scheme.get("input_activations") or {}
    static = bool(activations) and not activations.get("dynamic", True)
    if static and "input_scale" not in tensors:
        raise ValueError(f"compressed-tensors {prefix}: static activation scales but no input_scale")
    return FP8Weight(tensors["weight"], tensors["weight_scale"], tensors["input_scale"] if static else None)


def read_compressed_tensors(model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each quantized layer as one GPTQWeight (int4) or FP8Weight named
    `<prefix>.weight`; everything else (dense layers, KV-cache scales) passes through."""
    config = quantization_config(model_cfg.path)
    if config.get("sparsity_config"):
        raise ValueError("compressed-tensors checkpoints with sparsity (sparsity_config) are not supported")
    for name, item in iter_grouped_tensors(safetensors_files(model_cfg.path), PARTS, marker="weight_scale"):
        if not isinstance(item, dict):
            yield name, item
            continue
        scheme = scheme_for(config, name)
        if "weight_packed" in item:
            yield f"{name}.weight", int4_weight(name, item, scheme)
        elif item.get("weight") is not None and item["weight"].dtype == torch.float8_e4m3fn:
            yield f"{name}.weight", fp8_weight(name, item, scheme)
        else:
            kind = item["weight"].dtype if "weight" in item else "no weight"
            raise ValueError(
                f"compressed-tensors {name}: {kind} weights with a weight_scale are not supported "
                f"(only pack-quantized int4 and float-quantized FP8)"
            )
