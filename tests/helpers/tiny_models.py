"""Tiny random-weight Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3) saved as safetensors for worker tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama-tied-mha": lambda: LlamaConfig(
        **{**_COMMON, "num_key_value_heads": 4},
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # original_max_position_embeddings is small so that positions in the test reach the scaled frequencies.
    "llama3-rope": lambda: LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**{**_COMMON, "num_key_value_heads": 1}, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True),
    # 3 KV heads split 2 + 1 over two ranks, and a vocabulary that does not split evenly either
    "llama-uneven-tp": lambda: LlamaConfig(
        **{**_COMMON, "vocab_size": 321, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter (biases and norm weights included) a random value, so none of them can be ignored."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def make_tiny_checkpoint(kind: str, directory: Path, seed: int = 0, max_shard_size: str | None = None):
    """Save a tiny random `kind` model under `directory`; returns the float32 HF model (the reference)."""
    config = TINY_CONFIGS[kind]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return model
