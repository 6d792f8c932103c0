"""PEFT LoRA adapter folders for the serving tests: `adapter_config.json` and `adapter_model.safetensors`, written as
PEFT lays them out (random A and B for the target modules of every layer). The serving side checks the layout and the
rank; these weights are not compared against anything here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def write_lora_adapter(
    folder: Path,
    *,
    rank: int = 8,
    hidden_size: int = 64,
    num_layers: int = 2,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    peft_type: str = "LORA",
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
    seed: int = 0,
) -> Path:
    """A PEFT LoRA adapter of rank `rank` in `folder` (created); returns the folder."""
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
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, hidden_size), dtype=np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((hidden_size, rank), dtype=np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
