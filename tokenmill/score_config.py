"""How a sequence classifier turns its logits into answers, read from its files; torch-free, so the frontend can
label and check requests.

A classifier instance (`--task classify` or `score`) serves three endpoints from one head:
- /classify: probabilities over the labels (softmax; sigmoid for a single label), labelled by config `id2label`.
- /score and /rerank: sentence-transformers' `CrossEncoder.predict` score: the activation its config names
  (`sentence_transformers.activation_fn`, or the pre-v4 `sbert_ce_default_activation_function`), else sigmoid for
  one label and none for several.
A decoder reranker scored from its LM head (vLLM's `classifier_from_token`, through `--hf-overrides`) has one label
per named token, or one label `yes - no` when `is_original_qwen3_reranker` is set (Qwen3-Reranker).
The head itself runs in the worker (`workers/scoring_runner.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

Activation = Literal["sigmoid", "softmax", "identity", "tanh"]

# the torch.nn activation classes CrossEncoder configs name, by class name (the module path varies between versions)
_CROSS_ENCODER_ACTIVATIONS: dict[str, Activation] = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


class ScoreConfig(msgspec.Struct, frozen=True, kw_only=True):
    num_labels: int
    labels: list[str]  # label i's name (id2label), LABEL_i where the config names none
    score_activation: Activation  # what /score and /rerank apply (CrossEncoder's)
    classifier_from_token: list[str] | None = None  # LM-head rows that make the head of a decoder reranker
    is_original_qwen3_reranker: bool = False  # one label: the `yes` row minus the `no` row

    @property
    def classify_activation(self) -> Activation:
        return "sigmoid" if self.num_labels == 1 else "softmax"


def load_score_config(model_dir: str, hf_overrides: dict[str, Any] | None = None) -> ScoreConfig:
    """The classifier head's shape and activations, from config.json with `hf_overrides` applied."""
    config = {**json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")), **(hf_overrides or {})}
    from_token = config.get("classifier_from_token")
    qwen3_reranker = bool(config.get("is_original_qwen3_reranker", False))
    if from_token is not None and (not isinstance(from_token, list) or not from_token):
        raise ValueError(f"classifier_from_token must be a non-empty list of tokens, got {from_token!r}")
    if qwen3_reranker and (from_token is None or len(from_token) != 2):
        raise ValueError('is_original_qwen3_reranker needs classifier_from_token ["no", "yes"]')
    id2label = {int(key): str(value) for key, value in (config.get("id2label") or {}).items()}
    if qwen3_reranker:
        num_labels = 1
    elif from_token is not None:
        num_labels = len(from_token)
    else:
        num_labels = int(config.get("num_labels") or len(id2label) or 2)  # transformers' default is 2
    labels = [id2label.get(i, f"LABEL_{i}") for i in range(num_labels)]
    return ScoreConfig(
        num_labels=num_labels,
        labels=labels,
        score_activation=_cross_encoder_activation(config, num_labels),
        classifier_from_token=from_token,
        is_original_qwen3_reranker=qwen3_reranker,
    )


def _cross_encoder_activation(config: dict[str, Any], num_labels: int) -> Activation:
    """CrossEncoder's default `activation_fn` for this config (sentence_transformers/cross_encoder/model.py)."""
    path = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
        "sbert_ce_default_activation_function"
    )
    if path is None:
        return "sigmoid" if num_labels == 1 else "identity"
    name = str(path).rsplit(".", 1)[-1]
    if name not in _CROSS_ENCODER_ACTIVATIONS:
        raise ValueError(
            f"the model's CrossEncoder activation {path!r} is not supported "
            f"(only {', '.join(sorted(_CROSS_ENCODER_ACTIVATIONS))})"
        )
    return _CROSS_ENCODER_ACTIVATIONS[name]
