"""What the worker reads off a loaded model and its checkpoint: the language model's config, the EOS token ids and
the bytes of weights a step reads (reported to the scheduler in WorkerReady)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tokenmill.workers.quantization.base import QuantizedWeight


def text_config(hf_config: Any) -> Any:
    """The language model's config: a multimodal config's `text_config` (Gemma 3), else the config itself."""
    # transformers' PretrainedConfig.get_text_config, absent from older configs
    get_text_config = getattr(hf_config, "get_text_config", None)
    return get_text_config() if get_text_config is not None else hf_config


def read_eos_token_ids(model_path: str, hf_config: Any) -> list[int]:
    """From generation_config.json when the checkpoint has one, else the model config's eos_token_id."""
    eos = None
    generation_config = os.path.join(model_path, "generation_config.json")
    if os.path.exists(generation_config):
        with open(generation_config) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:  # HF configs carry the fields their model type defines
        eos = getattr(hf_config, "eos_token_id", None) or getattr(text_config(hf_config), "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(token) for token in eos]


def weight_bytes(model: torch.nn.Module) -> int:
    """Dense parameters and the buffers of quantized weights (the bytes a decode step reads), tied ones once."""
    quantized = [b for m in model.modules() if isinstance(m, QuantizedWeight) for b in m.buffers(recurse=False)]
    unique = {t.data_ptr(): t for t in [*model.parameters(), *quantized]}.values()
    return sum(t.numel() * t.element_size() for t in unique)
