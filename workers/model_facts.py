"""What the worker reads off a loaded model and its checkpoint: the language model's config, the EOS token ids and
the bytes of weights a step reads (reported to the scheduler in WorkerReady)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tokenmill.workers.models.layers import VocabEmbedding
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


# log_softmax, rank and top-k over one logit, in multiply-adds of the LM head: on CPU, 32 rows of a 49k vocabulary
# score in about the time their LM head takes at hidden size 64
SCORE_MACS_PER_LOGIT = 64


def body_weight_elements(model: torch.nn.Module) -> int:
    """The weights a token's forward multiplies by, each once: every dense parameter and quantized weight outside the
    vocabulary-sized tables (embedding, LM head), tied ones once. A mixture of experts counts every expert."""
    vocabulary_tables = [m for m in model.modules() if isinstance(m, VocabEmbedding)]
    skipped = {id(t) for table in vocabulary_tables for t in [*table.parameters(), *table.modules()]}
    counted: dict[int, int] = {}
    for module in model.modules():
        if id(module) in skipped:
            continue
        if isinstance(module, QuantizedWeight):
            counted[id(module)] = module.numel()
        for parameter in module.parameters(recurse=False):
            if id(parameter) not in skipped:
                counted[id(parameter)] = parameter.numel()
    return sum(counted.values())


def prompt_logprobs_row_cost(model: torch.nn.Module, vocab_size: int, hidden_size: int) -> float:
    """What one prompt position's logprobs cost beyond its forward (the LM head and scoring over the vocabulary), in
    tokens of forward through the body: ~85 for a 2-layer test model of hidden size 64, ~0.3 for SmolLM2-135M, ~0.1
    for an 8B Llama. The scheduler charges it to the step's token budget."""
    body = body_weight_elements(model)
    return vocab_size * (hidden_size + SCORE_MACS_PER_LOGIT) / max(body, 1)
