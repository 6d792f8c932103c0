"""The model runner of a sequence-classifier instance (`--task classify` / `score`): rerankers and classifiers.

It runs a step exactly as the embedding runner does (whole requests, one forward, no KV kept), then replaces pooling
with a classification head and its activation:
- BERT-family cross-encoders (`workers/models/bert_classifier.py`): the model's own head on the first token.
- decoders (`LlamaForSequenceClassification`-style): the last token's hidden state times the checkpoint's `score`
  matrix [num_labels, H]; or, for a reranker scored from its LM head (vLLM's `classifier_from_token` through
  `--hf-overrides`), the LM-head rows of those tokens, or the `yes` row minus the `no` row when
  `is_original_qwen3_reranker` is set, so the score is sigmoid(logit_yes - logit_no).

Each request gets its own task's activation (`tokenmill/score_config.py`): "score" as CrossEncoder.predict, "classify"
as probabilities. The answer travels back as float32 bytes, one value per label, in `StepResult.embeddings`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from tokenmill.config import EngineConfig
from tokenmill.messages import NewRequestData
from tokenmill.score_config import Activation, ScoreConfig, load_score_config
from tokenmill.workers.embedding_runner import EmbeddingRunner, decoder_body_weights
from tokenmill.workers.quantization.base import QuantizedWeight
from tokenmill.workers.worker import Worker

log = logging.getLogger(__name__)

# checkpoint tensors a decoder's head may be made of: its own score matrix, or rows of the LM head (the input
# embeddings when the two are tied)
_HEAD_SOURCES = ("score.weight", "lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")


class ScoringRunner(EmbeddingRunner):
    tasks = ("classify", "score")

    def __init__(self, config: EngineConfig, rank: int = 0):
        super().__init__(config, rank)
        self.score_config: ScoreConfig = load_score_config(config.model.path, config.model.hf_overrides)
        self.head_sources: dict[str, torch.Tensor] = {}  # decoders: the checkpoint tensors the head is built from
        self.score_weight: torch.Tensor | None = None  # decoders: [num_labels, H]

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        if self.encoder:
            return super().checkpoint_weights()
        return decoder_body_weights(self._keep_head_sources(Worker.checkpoint_weights(self)))

    def _keep_head_sources(
        self, weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Every tensor but `score.weight` passes on; the head's possible sources are kept on the side."""
        for name, tensor in weights:
            if name in _HEAD_SOURCES:
                if not isinstance(tensor, torch.Tensor):
                    raise NotImplementedError(f"a quantized {name} cannot make a classifier head")
                self.head_sources[name] = tensor
            if name != "score.weight":
                yield name, tensor

    def load_output_head(self) -> None:
        config = self.score_config
        if not self.encoder:
            self.score_weight = self._decoder_score_weight().to(device=self.device, dtype=self.dtype)
        self.head_sources.clear()
        log.info(
            "classifier: %d label(s); /score and /rerank apply %s, /classify %s",
            config.num_labels,
            config.score_activation,
            config.classify_activation,
        )

    def _decoder_score_weight(self) -> torch.Tensor:
        config = self.score_config
        if config.classifier_from_token is None:
            if "score.weight" not in self.head_sources:
                raise ValueError(
                    f"{self.architecture} checkpoint has no score.weight (a causal LM scored from its yes/no tokens "
                    "needs classifier_from_token in --hf-overrides)"
                )
            weight = self.head_sources["score.weight"]
        else:
            rows = self._lm_head()[self._token_ids(config.classifier_from_token)]
            weight = rows[1:2] - rows[0:1] if config.is_original_qwen3_reranker else rows
        if weight.shape[0] != config.num_labels:
            raise ValueError(f"the classifier head has {weight.shape[0]} labels, the config {config.num_labels}")
        return weight

    def _lm_head(self) -> torch.Tensor:
        for name in _HEAD_SOURCES[1:]:
            if name in self.head_sources:
                return self.head_sources[name]
        raise ValueError("classifier_from_token needs the checkpoint's LM head (or tied input embeddings)")

    def _token_ids(self, tokens: list[str]) -> list[int]:
        from transformers import AutoTokenizer

        model_cfg = self.config.model
        tokenizer = AutoTokenizer.from_pretrained(model_cfg.tokenizer or model_cfg.path)
        ids = [int(i) for i in tokenizer.convert_tokens_to_ids(tokens)]
        unknown = [tok for tok, i in zip(tokens, ids, strict=True) if tokenizer.convert_ids_to_tokens(i) != tok]
        if unknown:
            raise ValueError(f"classifier_from_token names tokens that are not in the vocabulary: {unknown}")
        return ids

    def outputs(self, hidden: torch.Tensor, starts: torch.Tensor, requests: list[NewRequestData]) -> torch.Tensor:
        """[B, num_labels] float32: each request's logits through its task's activation."""
        if self.encoder:
            logits = self.model.classify(hidden, starts)
        else:
            assert self.score_weight is not None, "load_model() first"
            last = hidden.index_select(0, starts[1:].to(torch.int64) - 1)
            logits = (last @ self.score_weight.T).float()
        config = self.score_config
        is_score = torch.tensor([new.task == "score" for new in requests], device=logits.device)
        scored = _activate(logits, config.score_activation)
        classified = _activate(logits, config.classify_activation)
        return torch.where(is_score[:, None], scored, classified)


def _activate(logits: torch.Tensor, activation: Activation) -> torch.Tensor:
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "tanh":
        return torch.tanh(logits)
    return logits
