"""BERT-family cross-encoders (`BertForSequenceClassification`, `(XLM)RobertaForSequenceClassification`): the encoder
of `bert.py` and a head on each sequence's first token (CLS / <s>).

Both families' heads compute `out(tanh(dense(first_token_hidden)))`, only named differently in the checkpoints:

    BERT      bert.pooler.dense (the pooler)   classifier          (the classifier)
    RoBERTa   classifier.dense                 classifier.out_proj

    forward(input_ids[T], positions[T], query_start_loc[B + 1], token_type_ids[T] | None) -> hidden[T, H]
    classify(hidden[T, H], query_start_loc[B + 1]) -> logits[B, num_labels]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.workers.models.bert import BertEmbeddingModel, strip_model_prefix
from tokenmill.workers.models.packed_linear import PackableLinear

# checkpoint name (model prefix stripped) -> head parameter, per family
_BERT_HEAD_NAMES = {
    "pooler.dense.weight": "dense.weight",
    "pooler.dense.bias": "dense.bias",
    "classifier.weight": "out.weight",
    "classifier.bias": "out.bias",
}
_ROBERTA_HEAD_NAMES = {
    "classifier.dense.weight": "dense.weight",
    "classifier.dense.bias": "dense.bias",
    "classifier.out_proj.weight": "out.weight",
    "classifier.out_proj.bias": "out.bias",
}


class FirstTokenClassifierHead(nn.Module):
    """first token's hidden [B, H] -> out(tanh(dense(.))) [B, num_labels] (dropout is off at inference)."""

    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.dense = PackableLinear(hidden_size, hidden_size)
        self.out = PackableLinear(hidden_size, num_labels)

    def forward(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first_token_hidden)))


class BertForSequenceClassification(nn.Module):
    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.encoder_model = BertEmbeddingModel(hf_config, dtype, device)
        roberta = getattr(hf_config, "model_type", "bert") in ("roberta", "xlm-roberta")
        self.head_names = _ROBERTA_HEAD_NAMES if roberta else _BERT_HEAD_NAMES
        with torch.device("meta"):  # no random init: load_weights fills every parameter
            self.head = FirstTokenClassifierHead(hf_config.hidden_size, hf_config.num_labels)
        self.head.to(dtype)
        self.head.to_empty(device=device)
        self.head.requires_grad_(False)

    @property
    def hidden_size(self) -> int:
        return self.encoder_model.hidden_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.encoder_model(input_ids, positions, query_start_loc, token_type_ids=token_type_ids)

    def classify(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """Each sequence's logits [B, num_labels], in float32, from its first token's hidden state."""
        first = hidden.index_select(0, query_start_loc[:-1].to(device=hidden.device, dtype=torch.int64))
        return self.head(first).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The head's tensors into the head, the rest into the encoder; fail on any head tensor missing."""
        head_params = dict(self.head.named_parameters())
        filled: set[str] = set()

        def encoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                target = self.head_names.get(strip_model_prefix(name))
                if target is None:
                    yield name, tensor
                    continue
                dest = head_params[target].data
                if dest.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match {dest.shape}")
                dest.copy_(tensor)
                filled.add(target)

        self.encoder_model.load_weights(encoder_weights())
        missing = sorted(set(head_params) - filled)
        if missing:
            raise ValueError(f"the checkpoint has no classifier head tensors for {missing}")
