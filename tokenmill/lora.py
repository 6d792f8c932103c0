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
from dataclasses import dataclass
from pathlib import Path

from tokenmill.messages import LoRARequest

__all__ = ["LORA_TARGET_MODULES", "LoRARequest", "PeftAdapterConfig", "read_peft_config"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections of a decoder layer an adapter may target (PEFT's module names)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_UNSUPPORTED_MODULES = ("embed_tokens", "lm_head")


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
