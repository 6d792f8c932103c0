"""One LoRA adapter read from its PEFT folder into host memory: per decoder layer and projection its A [r, in] and
its B [out, r] with the adapter's scale folded in, float32 on the CPU (the LRU host cache keeps these)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from tokenmill.lora import LORA_WEIGHT_NAME, read_peft_config
from tokenmill.messages import LoRARequest


@dataclass(frozen=True)
class LoRAPair:
    """One projection's low-rank update: delta(x) = (x @ a.T) @ b.T, the scale already in `b`."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]


@dataclass(frozen=True)
class LoRAAdapter:
    request: LoRARequest
    rank: int
    pairs: dict[tuple[int, str], LoRAPair]  # (layer index, PEFT projection name) -> its update

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


def load_adapter(request: LoRARequest, max_lora_rank: int, num_layers: int) -> LoRAAdapter:
    """The adapter `request` names, read and checked (ValueError naming what is wrong: rank above `max_lora_rank`,
    a module tokenmill does not serve, a layer the model lacks, mismatched A/B)."""
    config = read_peft_config(request.lora_path, max_lora_rank)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(config.weights_file)).items():
        match = LORA_WEIGHT_NAME.search(name)
        if match is None:
            what = "an embedding or LM head" if ("embed" in name or "lm_head" in name) else "an unrecognised module"
            raise ValueError(f"LoRA adapter {request.lora_name!r}: tensor {name!r} targets {what}, not supported")
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: tensor {name!r} names layer {layer} of {num_layers}")
        halves.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor.float()
    pairs = {key: _pair(request, key, parts, config.rank, config.scale) for key, parts in halves.items()}
    if not pairs:
        raise ValueError(f"LoRA adapter {request.lora_name!r} has no lora_A/lora_B weights")
    return LoRAAdapter(request, config.rank, pairs)


def _pair(
    request: LoRARequest, key: tuple[int, str], parts: dict[str, torch.Tensor], rank: int, scale: float
) -> LoRAPair:
    a, b = parts.get("A"), parts.get("B")
    where = f"LoRA adapter {request.lora_name!r}, layer {key[0]} {key[1]}"
    if a is None or b is None:
        raise ValueError(f"{where}: lora_A and lora_B must both be present")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have rank {rank}")
    return LoRAPair(a.contiguous(), (b * scale).contiguous())
