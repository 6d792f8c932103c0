"""PEFT LoRA adapters for tests: made with `peft` on a transformers model, with random non-zero A and B (PEFT
starts B at zero, which would make every adapter the identity), saved in PEFT's layout."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

QV = ("q_proj", "v_proj")
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_model(
    base_model,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    use_rslora: bool = False,
    lora_alpha: int | None = None,
):
    """A PeftModel over a copy of `base_model` whose adapter's A and B are random: a delta about the size of the
    base projection's output, so that the adapter changes greedy tokens."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * rank,
        target_modules=list(targets),
        lora_dropout=0.0,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:  # [r, in]
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:  # [out, r]
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
    return peft_model.eval()


def save_peft_adapter(peft_model, directory: Path) -> Path:
    peft_model.save_pretrained(directory, safe_serialization=True)
    return directory


def build_smollm2_shaped_checkpoint(root: Path, num_layers: int = 4, seed: int = 0):
    """SmolLM2-135M's real config (read from the shipped GGUF: hidden 576, 9 query / 3 KV heads, MLP 1536, its
    vocabulary) with `num_layers` layers of random weights, saved with its tokenizer; returns (path, float32 model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir, smollm2_tokenizer
    from tests.helpers.tiny_models import randomize_

    config = AutoConfig.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    config.num_hidden_layers = num_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    path = root / "smollm2-shaped"
    model.save_pretrained(path, safe_serialization=True)
    smollm2_tokenizer().save_pretrained(path)
    return path, model.eval()
