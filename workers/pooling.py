"""Pooling for embedding models: per-token hidden states of a packed batch -> one float32 vector per sequence.

`pool` is one vectorized pass over the whole batch; `truncate_embeddings` serves the OpenAI `dimensions` field. What
to pool and whether to normalize come from the model's files (`tokenmill/pooling_config.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.pooling_config import PoolingConfig


def pool(hidden: torch.Tensor, query_start_loc: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """hidden [T, H] of B packed sequences (`query_start_loc` [B + 1]) -> float32 [B, H], L2-normalized if asked."""
    starts = query_start_loc.to(device=hidden.device, dtype=torch.int64)
    if config.mode == "cls":
        pooled = hidden.index_select(0, starts[:-1]).float()
    elif config.mode == "last":
        pooled = hidden.index_select(0, starts[1:] - 1).float()
    elif config.mode == "mean":
        lengths = starts[1:] - starts[:-1]
        num_sequences = lengths.numel()
        sequence_of_token = torch.repeat_interleave(
            torch.arange(num_sequences, device=hidden.device), lengths, output_size=hidden.shape[0]
        )
        sums = torch.zeros(num_sequences, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, sequence_of_token, hidden.float())
        pooled = sums / lengths.unsqueeze(1).to(torch.float32)
    else:
        raise ValueError(f"unknown pooling mode {config.mode!r}")
    return F.normalize(pooled, p=2.0, dim=-1) if config.normalize else pooled


def truncate_embeddings(embeddings: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """Keep the first `dimensions` features of [B, H] embeddings, re-normalizing them when the model normalizes."""
    truncated = embeddings[..., :dimensions]
    return F.normalize(truncated, p=2.0, dim=-1) if normalize else truncated
