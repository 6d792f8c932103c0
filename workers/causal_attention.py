"""A long prompt's causal attention on the CPU as torch's flash-attention kernel over a split of the causal triangle.

torch's CPU flash kernel skips the causal triangle's masked half only in whole key blocks of 512 (its kv split): at
1,024 queries it computes about 3/4 of the full square instead of 1/2 (one thread, Qwen2.5-0.5B's 14/2 heads of 64:
31.6 ms causal against 41.8 ms for the full square), and a square of 512 or fewer costs as much causal as full. So the
triangle is split recursively: the queries' upper half attends its own triangle, the lower half attends the upper
half's keys in full (one unmasked call, nothing wasted) and its own triangle, and the two partial results are merged
through their log-sum-exps. Down to `LEAF_QUERIES` the kernel's own causal path runs. Keys cached before the
queries (a later prompt chunk, a prefix-cache hit) are one more unmasked call over all queries, merged the same way,
so chunked prefill needs no materialised mask either.

Each key is still seen by each query exactly once, in float32 with the kernel's online softmax; only the order of the
sums changes, so results differ from one causal call by rounding (tests/workers/test_causal_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to this many queries the triangle is one causal kernel call. One thread, Qwen2.5-0.5B's heads, 1,024 queries:
# leaves of 64 / 128 / 256 took 28.2 / 28.4 / 29.6 ms against the one causal call's 31.9 (256 queries: 2.2 / 2.4 /
# 2.8 against 2.8).
LEAF_QUERIES = 64

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def takes(query: torch.Tensor) -> bool:
    """Whether `causal_prompt_attention` takes this query: a float32 CPU tensor (the merge runs in its dtype)."""
    return query.dtype == torch.float32 and query.device.type == "cpu"


def _merge_into(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor) -> None:
    """(out, lse) := the softmax-weighted union of two partial attentions over disjoint keys, in place: other's
    share of the union's weight is sigmoid(other_lse - lse)."""
    gap = other_lse - lse
    out.lerp_(other, torch.sigmoid(gap).unsqueeze(-1))
    lse.add_(F.softplus(gap))


def _attend_triangle(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Causal attention of `query` `[1, Hq, n, D]` over `key`/`value` `[1, Hkv, n, D]` (query i sees keys <= i) into
    `out` `[1, Hq, n, D]` and its log-sum-exp into `lse` `[1, Hq, n]`."""
    n = query.shape[2]
    if n <= LEAF_QUERIES:
        leaf_out, leaf_lse = _flash(query, key, value, is_causal=True, scale=scale)
        out.copy_(leaf_out)
        lse.copy_(leaf_lse)
        return
    half = -(-n // 2 // LEAF_QUERIES) * LEAF_QUERIES  # a whole number of leaves above the split
    upper_keys, upper_values = key[:, :, :half], value[:, :, :half]
    _attend_triangle(query[:, :, :half], upper_keys, upper_values, scale, out[:, :, :half], lse[:, :, :half])
    lower, lower_out, lower_lse = query[:, :, half:], out[:, :, half:], lse[:, :, half:]
    _attend_triangle(lower, key[:, :, half:], value[:, :, half:], scale, lower_out, lower_lse)
    prefix_out, prefix_lse = _flash(lower, upper_keys, upper_values, is_causal=False, scale=scale)
    _merge_into(lower_out, lower_lse, prefix_out, prefix_lse)


def causal_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """`[1, Hq, n, D]`: the attention of a prompt's last n tokens `query` `[1, Hq, n, D]` over all of its keys
    `key`/`value` `[1, Hkv, s, D]` (s >= n; the first s - n are cached before the queries), causal: the query at
    position s - n + i sees keys <= s - n + i. Grouped-query heads (Hq a multiple of Hkv) share their KV head."""
    n, num_keys = query.shape[2], key.shape[2]
    cached = num_keys - n
    out = query.new_empty(query.shape)
    lse = query.new_empty(query.shape[:3])
    _attend_triangle(query, key[:, :, cached:], value[:, :, cached:], scale, out, lse)
    if cached:
        prefix_out, prefix_lse = _flash(query, key[:, :, :cached], value[:, :, :cached], is_causal=False, scale=scale)
        _merge_into(out, lse, prefix_out, prefix_lse)
    return out
