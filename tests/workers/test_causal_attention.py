"""The split-triangle causal prompt attention (workers/causal_attention.py) against a float64 reference and torch's
SDPA: fresh prompts of one leaf, of several, of a ragged length; a later chunk over cached keys; grouped-query heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.workers import causal_attention
from tokenmill.workers.causal_attention import causal_prompt_attention

SCALE = 0.125


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """float64 masked softmax: query i of n (the prompt's last n of s tokens) sees keys <= s - n + i."""
    n, s = query.shape[2], key.shape[2]
    group = query.shape[1] // key.shape[1]
    k, v = key.double().repeat_interleave(group, 1), value.double().repeat_interleave(group, 1)
    scores = query.double() @ k.transpose(-1, -2) * SCALE
    visible = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).float()


def prompt(num_queries: int, num_keys: int, heads: int = 14, kv_heads: int = 2) -> tuple[torch.Tensor, ...]:
    """Query `[1, heads, n, 64]` and key/value `[1, kv_heads, s, 64]`, strided as the worker hands them over."""
    generator = torch.Generator().manual_seed(num_queries * 7919 + num_keys)
    query = torch.randn(num_queries, heads, 64, generator=generator).transpose(0, 1)[None]
    key, value = (torch.randn(num_keys, kv_heads, 64, generator=generator).transpose(0, 1)[None] for _ in range(2))
    return query, key, value


@pytest.mark.parametrize(
    ("num_queries", "num_keys"),
    [(17, 17), (64, 64), (300, 300), (513, 513), (200, 300), (129, 1000), (64, 65)],
)
def test_matches_float64_reference_and_sdpa(num_queries: int, num_keys: int) -> None:
    query, key, value = prompt(num_queries, num_keys)
    out = causal_prompt_attention(query, key, value, SCALE)
    expected = reference_attention(query, key, value)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    visible = torch.arange(num_keys)[None, :] <= torch.arange(num_keys - num_queries, num_keys)[:, None]
    sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(out, sdpa, atol=2e-6, rtol=1e-5)


def test_split_leaves_give_the_one_call_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny leaves (many levels of splits and merges) and one leaf covering everything agree."""
    query, key, value = prompt(256, 256, heads=4, kv_heads=4)
    monkeypatch.setattr(causal_attention, "LEAF_QUERIES", 8)
    split = causal_prompt_attention(query, key, value, SCALE)
    monkeypatch.setattr(causal_attention, "LEAF_QUERIES", 4096)
    whole = causal_prompt_attention(query, key, value, SCALE)
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(split, reference_attention(query, key, value), atol=2e-6, rtol=1e-5)


def test_takes_only_float32_cpu() -> None:
    query = torch.zeros(1, 2, 4, 8)
    assert causal_attention.takes(query)
    assert not causal_attention.takes(query.bfloat16())
