"""LoRA adapters in PEFT's layout, read and checked without torch: what any process (the offline API, the
frontend at `/v1/load_lora_adapter`, the worker) needs to know of an adapter before its weights are read.

A PEFT adapter folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`, `use_rslora`, ...) and
`adapter_model.safetensors` (`...layers.N.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]).
tokenmill serves adapters on the decoder's q/k/v/o and gate/up/down projections; anything else an adapter changes
(embeddings, the LM head, biases, DoRA, extra trained modules) is refused with a sentence naming it, never ignored.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from tokenmill.messages import LoRARequest

__all__ = ["LORA_TARGET_MODULES", "LoRARequest", "PeftAdapterConfig", "check_adapter_tensors", "read_peft_config"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections of a decoder layer an adapter may target (PEFT's module names)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_UNSUPPORTED_MODULES = ("embed_tokens", "lm_head")
# `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` -> (3, "q_proj", "A")
LORA_WEIGHT_NAME = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(LORA_TARGET_MODULES) + r")\.lora_([AB])(?:\.default)?\.weight$"
)
_READS_HIDDEN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # lora_A [r, hidden]; o/down: lora_B [hidden, r]
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class PeftAdapterConfig:
    """What tokenmill reads from `adapter_config.json`."""

    path: Path
    rank: int  # `r`
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # () when the config names them by a regular expression

    @property
    def scale(self) -> float:
        """The factor on B @ A: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (PEFT's `scaling`)."""
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE


def read_peft_config(path: str | Path, max_lora_rank: int) -> PeftAdapterConfig:
    """The adapter config of the PEFT folder `path`; ValueError (one sentence naming the field) when the folder is
    not an adapter tokenmill can serve: files missing, rank above `max_lora_rank`, or an unsupported feature."""
    folder = Path(path)
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter path {str(folder)!r} has no {CONFIG_FILE}")
    if not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"LoRA adapter path {str(folder)!r} has no {WEIGHTS_FILE}")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {CONFIG_FILE} in {str(folder)!r} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"LoRA adapter {CONFIG_FILE} in {str(folder)!r} is not a JSON object")
    _refuse_unsupported(raw, folder)
    rank = raw.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"LoRA adapter {str(folder)!r}: 'r' must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter {str(folder)!r} has rank {rank}, above max_lora_rank={max_lora_rank} "
            "(raise --max-lora-rank to serve it)"
        )
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {str(folder)!r}: 'lora_alpha' must be a number, got {alpha!r}")
    targets = raw.get("target_modules") or ()
    targets = tuple(targets) if isinstance(targets, list) else ()  # a string is a regular expression
    return PeftAdapterConfig(folder, rank, float(alpha), bool(raw.get("use_rslora", False)), targets)


def _refuse_unsupported(raw: dict[str, object], folder: Path) -> None:
    """ValueError naming the first adapter feature tokenmill would otherwise silently get wrong."""
    where = f"LoRA adapter {str(folder)!r}"
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
    if raw.get("use_dora"):
        raise ValueError(f"{where}: use_dora (DoRA) is not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={raw.get('bias')!r} is not supported (only 'none')")
    if raw.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out (Conv1D-style weights) is not supported")
    if raw.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {raw['modules_to_save']!r} is not supported")
    for field in ("rank_pattern", "alpha_pattern"):
        if raw.get(field):
            raise ValueError(f"{where}: a per-module {field} is not supported")
    targets = raw.get("target_modules") or []
    for module in targets if isinstance(targets, list) else []:
        if module in _UNSUPPORTED_MODULES:
            supported = ", ".join(LORA_TARGET_MODULES)
            raise ValueError(f"{where}: target module {module!r} is not supported (only {supported})")


def check_adapter_tensors(config: PeftAdapterConfig, hidden_size: int = 0) -> None:
    """ValueError unless every tensor of the adapter's safetensors (its header only: names and shapes, no weights)
    is a lora_A [r, in] or lora_B [out, r] of a served projection, of the config's rank, and, given the base model's
    `hidden_size`, of its width: an adapter made for another base model is refused here, not in the worker."""
    where = f"LoRA adapter {str(config.path)!r}"
    shapes = _safetensors_shapes(config.weights_file)
    for name, shape in shapes.items():
        match = LORA_WEIGHT_NAME.search(name)
        if match is None:
            what = "an embedding or LM head" if ("embed" in name or "lm_head" in name) else "an unrecognised module"
            raise ValueError(f"{where}: tensor {name!r} targets {what}, which is not supported")
        projection, half = match.group(2), match.group(3)
        rank_dim = 0 if half == "A" else 1
        if len(shape) != 2 or shape[rank_dim] != config.rank:
            raise ValueError(f"{where}: tensor {name!r} has shape {shape}, not rank r={config.rank}")
        hidden_dim = 1 if projection in _READS_HIDDEN else 0
        if hidden_size and (half == "A") == (projection in _READS_HIDDEN) and shape[hidden_dim] != hidden_size:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {shape}, which does not fit the base model's hidden size "
                f"{hidden_size} (an adapter of another base model?)"
            )
    if not shapes:
        raise ValueError(f"{where} has no lora_A/lora_B weights")


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's JSON header (8 bytes of little-endian length, then JSON)."""
    try:
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > _MAX_HEADER_BYTES:
                raise ValueError("header too large")
            header = json.loads(file.read(length))
        return {name: list(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise ValueError(f"LoRA adapter weights {str(path)!r} are not a readable safetensors file: {exc}") from None
