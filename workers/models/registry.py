"""Which model class serves which Hugging Face `architectures` name, imported only when asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the architecture table is read torch-free by `tokenmill serve` before any process starts
    from torch import nn

# HF architecture name -> (module, class)
_MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tokenmill.workers.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.workers.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.workers.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.workers.models.llama", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("tokenmill.workers.models.mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("tokenmill.workers.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Phi3ForCausalLM": ("tokenmill.workers.models.phi3", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("tokenmill.workers.models.gemma3", "Gemma3ForCausalLM"),
    # served text-only: the vision tower and projector are skipped at load
    "Gemma3ForConditionalGeneration": ("tokenmill.workers.models.gemma3", "Gemma3ForConditionalGeneration"),
    # encoders, served as embedding models only (task heads in the checkpoint are skipped at load)
    "BertModel": ("tokenmill.workers.models.bert", "BertEmbeddingModel"),
    "BertForMaskedLM": ("tokenmill.workers.models.bert", "BertEmbeddingModel"),
    "RobertaModel": ("tokenmill.workers.models.bert", "BertEmbeddingModel"),
    "XLMRobertaModel": ("tokenmill.workers.models.bert", "BertEmbeddingModel"),
    # sequence classifiers (--task classify / score): cross-encoders with their pooler and classifier, and decoders
    # built as their causal LM, the `score` head (or the LM head's classifier_from_token rows) kept by the runner
    "BertForSequenceClassification": ("tokenmill.workers.models.bert_classifier", "BertForSequenceClassification"),
    "RobertaForSequenceClassification": ("tokenmill.workers.models.bert_classifier", "BertForSequenceClassification"),
    "XLMRobertaForSequenceClassification": (
        "tokenmill.workers.models.bert_classifier",
        "BertForSequenceClassification",
    ),
    "LlamaForSequenceClassification": ("tokenmill.workers.models.llama", "LlamaForCausalLM"),
    "Qwen2ForSequenceClassification": ("tokenmill.workers.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForSequenceClassification": ("tokenmill.workers.models.llama", "Qwen3ForCausalLM"),
}
ENCODER_ARCHITECTURES = frozenset(
    name for name, (module, _) in _MODEL_CLASSES.items() if module.endswith((".bert", ".bert_classifier"))
)
CLASSIFIER_ARCHITECTURES = frozenset(name for name in _MODEL_CLASSES if name.endswith("ForSequenceClassification"))

# For configs that carry no `architectures` (GGUF metadata gives only the model type).
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}


def is_encoder(architecture: str) -> bool:
    """Bidirectional encoders: no KV cache, no logits; built as `cls(hf_config, dtype, device)`."""
    return architecture in ENCODER_ARCHITECTURES


def supported_architectures() -> list[str]:
    return sorted(_MODEL_CLASSES)


def architecture_of(hf_config) -> str:
    """The first supported name in `config.architectures`, else the one implied by `config.model_type`."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in _MODEL_CLASSES:
            return name
    by_type = _ARCHITECTURE_BY_MODEL_TYPE.get(getattr(hf_config, "model_type", ""))
    if by_type is not None and not names:
        return by_type
    raise ValueError(
        f"unsupported model architecture {names or getattr(hf_config, 'model_type', None)}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODEL_CLASSES:
        supported = ", ".join(supported_architectures())
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {supported}")
    module_name, class_name = _MODEL_CLASSES[architecture]
    return getattr(importlib.import_module(module_name), class_name)
