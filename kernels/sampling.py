"""Batched top-k / top-p / min-p filtering of `[B, V]` logits with per-row parameters.

Why torch and not Triton: top-k and top-p need each row's order statistics. A Triton version would
either sort inside a program (rows of 32k-256k entries do not fit one tile) or bisect a threshold
with tens of passes over the row; one batched `torch.sort` is simpler, exact, and of the same order
of cost. What matters for serving is kept: every operation is batched over rows, parameters are
device tensors, and nothing reads a value back to the host, so the sampler never syncs per row.

Semantics (the order HF's logits processors use): top-k, then top-p on the top-k-truncated
distribution, then min-p. `top_k <= 0` or `>= V` is off; `top_p >= 1` is off; `min_p <= 0` is off.
Each filter keeps the tokens whose logit is >= a per-row cutoff, so tokens tied with the cutoff are
all kept; filtered logits become -inf. Callers that know on the host that no row uses top-k/top-p
should skip the call (that is where the sort costs).
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def top_k_top_p_cutoffs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row logit cutoff `[B, 1]` implementing top-k then top-p (-inf where both are off)."""
    vocab_size = logits.shape[1]
    sorted_logits = logits.float().sort(dim=-1, descending=True).values

    k = top_k.to(device=logits.device, dtype=torch.long)
    top_k_on = (k > 0) & (k < vocab_size)
    kth_largest = sorted_logits.gather(1, (k.clamp(1, vocab_size) - 1)[:, None])
    top_k_cutoff = torch.where(top_k_on[:, None], kth_largest, _NEG_INF)

    # Top-p over what top-k kept: keep the shortest prefix whose mass reaches p (at least one token).
    p = top_p.to(device=logits.device, dtype=torch.float32)[:, None]
    truncated = sorted_logits.masked_fill(sorted_logits < top_k_cutoff, _NEG_INF)
    probs = truncated.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    num_kept = (mass_before < p).sum(dim=-1, keepdim=True).clamp(min=1)
    top_p_cutoff = torch.where(p < 1.0, truncated.gather(1, num_kept - 1), _NEG_INF)
    return torch.maximum(top_k_cutoff, top_p_cutoff)


def min_p_cutoffs(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Per-row logit cutoff `[B, 1]`: prob >= min_p * max prob  <=>  logit >= max logit + log(min_p)."""
    threshold = min_p.to(device=logits.device, dtype=torch.float32).clamp(min=0.0).log()[:, None]
    return logits.float().amax(dim=-1, keepdim=True) + threshold


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Return `logits[B, V]` with every token outside top-k, top-p and min-p set to -inf."""
    if logits.shape[0] == 0:
        return logits.clone()
    cutoffs = torch.maximum(top_k_top_p_cutoffs(logits, top_k, top_p), min_p_cutoffs(logits, min_p))
    return logits.masked_fill(logits < cutoffs, _NEG_INF)


def filter_logits_ref(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Row-by-row reference for `filter_logits`, written as the definitions read."""
    out = logits.clone()
    vocab_size = logits.shape[1]
    for row, (k, p, mp) in enumerate(zip(top_k.tolist(), top_p.tolist(), min_p.tolist())):
        values = out[row]
        if 0 < k < vocab_size:
            kth_largest = torch.topk(values, k).values[-1]
            values[values < kth_largest] = _NEG_INF
        if p < 1.0:
            probs = torch.softmax(values.float(), dim=-1)
            order = torch.argsort(values, descending=True).tolist()
            mass = 0.0
            cutoff = values[order[0]]
            for token in order:
                if mass >= p:
                    break
                cutoff = values[token]
                mass += probs[token].item()
            values[values < cutoff] = _NEG_INF
        if mp > 0.0:
            probs = torch.softmax(values.float(), dim=-1)
            values[probs < mp * probs.max()] = _NEG_INF
    return out
