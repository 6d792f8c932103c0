"""What the AWQ, GPTQ, FP8 and compressed-tensors readers share: the checkpoint's `quantization_config`, its int4
settings, the grouping of a layer's tensors (`q_proj.qweight`, `q_proj.scales`, ...) into one item, and the
dequantize-at-load pass for devices without the formats' kernels (CPU).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from tokenmill.workers.quantization.base import QuantizedWeight

log = logging.getLogger(__name__)


def quantization_config(path: str) -> dict:
    """`quantization_config` from config.json, else an older GPTQ checkpoint's `quantize_config.json`; {} if none."""
    config_file = os.path.join(path, "config.json")
    if os.path.exists(config_file):
        with open(config_file) as f:
            config = json.load(f).get("quantization_config")
        if config:
            return config
    legacy = os.path.join(path, "quantize_config.json")
    if os.path.exists(legacy):
        with open(legacy) as f:
            return json.load(f)
    return {}


class Int4Settings(NamedTuple):
    group_size: int  # -1: one group over the whole input dim
    desc_act: bool
    sym: bool


def int4_config(config: dict, method: str) -> Int4Settings:
    """The int4 settings of an AWQ/GPTQ `quantization_config`; a ValueError for any other bit width."""
    bits = config.get("bits", config.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"{method} checkpoint has quantization_config.bits={bits}: only 4-bit weights are supported")
    group_size = int(config.get("group_size", config.get("q_group_size", 128)))
    if group_size == 0 or group_size < -1:
        raise ValueError(f"{method} checkpoint has quantization_config.group_size={group_size}: expected -1 or > 0")
    return Int4Settings(group_size, bool(config.get("desc_act", False)), bool(config.get("sym", True)))


def _checkpoint_keys(files: list[str]) -> dict[str, str]:
    """tensor name -> the safetensors file holding it, over every shard."""
    from safetensors import safe_open

    where = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def iter_grouped_tensors(
    files: list[str], parts: Iterable[str], marker: str | None = None
) -> Iterator[tuple[str, torch.Tensor | dict[str, torch.Tensor]]]:
    """Every tensor of the checkpoint's safetensors `files` in file order; a layer holding `<prefix>.<marker>`
    (default: the first part) comes once, as (prefix, {part: tensor}) with whichever of `parts` it has, where the
    first of them is met.
    Other tensors come as (name, tensor)."""
    from safetensors import safe_open

    parts = tuple(parts)
    marker = marker or parts[0]
    where = _checkpoint_keys(files)
    grouped = {name.removesuffix(f".{marker}") for name in where if name.endswith(f".{marker}")}
    handles = {}

    def read(name: str) -> torch.Tensor:
        file = where[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt", device="cpu")
        return handles[file].get_tensor(name)

    done = set()
    for name in where:
        prefix, _, part = name.rpartition(".")
        if prefix in grouped and part in parts:
            if prefix not in done:
                done.add(prefix)
                yield prefix, {p: read(f"{prefix}.{p}") for p in parts if f"{prefix}.{p}" in where}
        else:
            yield name, read(name)


def dequantized(
    weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], dtype: torch.dtype, device: str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights with every QuantizedWeight replaced by its dense weight in `dtype` (one log line): how a device
    without the format's kernels (CPU) runs an AWQ/GPTQ/FP8 checkpoint."""
    logged = False
    for name, weight in weights:
        if isinstance(weight, QuantizedWeight):
            if not logged:
                log.info(
                    "dequantizing the %s weights to %s at load (on %s)",
                    weight.format,
                    str(dtype).removeprefix("torch."),
                    device,
                )
                logged = True
            weight = weight.dequantize(dtype)
        yield name, weight
