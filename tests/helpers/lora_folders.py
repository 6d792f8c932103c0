"""PEFT LoRA adapter folders for the serving tests: `adapter_config.json` and `adapter_model.safetensors`, written as
PEFT lays them out (`base_model.model.model.layers.{i}.self_attn.{module}.lora_A/B.weight`, random A and B). The
serving side checks the layout and the rank; nothing here compares outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# (out_features, in_features) of the attention projections of SmolLM2-135M (hidden 576, 9 heads, 3 KV heads of 64):
# an adapter the shipped default model can load
SMOLLM2_SHAPES = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576)}
SMOLLM2_LAYERS = 30


def write_lora_adapter(
    folder: Path,
    *,
    rank: int = 8,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    shapes: dict[str, tuple[int, int]] | None = None,
    num_layers: int = 2,
    peft_type: str = "LORA",
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
    seed: int = 0,
) -> Path:
    """A PEFT LoRA adapter of rank `rank` in `folder` (created); `shapes`: (out, in) per module (default 64 x 64)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": peft_type,
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(target_modules),
        "base_model_name_or_path": base_model,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in target_modules:
            out_features, in_features = (shapes or {}).get(module, (64, 64))
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.02 * rng.standard_normal((rank, in_features), dtype=np.float32)
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * rng.standard_normal((out_features, rank), dtype=np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
