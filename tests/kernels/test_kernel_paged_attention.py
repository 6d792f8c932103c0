"""Paged decode and varlen prefill attention kernels against their torch references (and SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.kernels_testutil import make_paged_cache
from tokenmill.kernels import paged_attention
from tokenmill.kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_prefill,
    paged_attention_prefill_ref,
)

TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
NUM_KV_HEADS = 2
DECODE_SEQ_LENS = [1, 17, 45, 70]  # one token, and lengths that are no multiple of 16 or 32
# (seq_len, q_len): full prefill, a decode token in the batch, a chunk after a cached prefix.
PREFILL_SEQS = [(37, 37), (50, 1), (45, 20)]


def run_decode(seq_lens, group, head_dim, block_size, dtype, cache_dtype=None, **kv_scales):
    cache = make_paged_cache(seq_lens, NUM_KV_HEADS, head_dim, block_size, cache_dtype or dtype)
    query = torch.randn(len(seq_lens), NUM_KV_HEADS * group, head_dim).to(dtype)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, head_dim**-0.5)
    return paged_attention_decode(*args, **kv_scales), paged_attention_decode_ref(*args, **kv_scales)


def run_prefill(seqs, group, head_dim, block_size, dtype, cache_dtype=None, **kv_scales):
    seq_lens = [seq_len for seq_len, _ in seqs]
    q_lens = torch.tensor([q_len for _, q_len in seqs])
    cache = make_paged_cache(seq_lens, NUM_KV_HEADS, head_dim, block_size, cache_dtype or dtype)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    query = torch.randn(int(q_lens.sum()), NUM_KV_HEADS * group, head_dim).to(dtype)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, head_dim**-0.5)
    return paged_attention_prefill(*args, **kv_scales), paged_attention_prefill_ref(*args, **kv_scales)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_matches_reference(group, block_size, head_dim):
    out, ref = run_decode(DECODE_SEQ_LENS, group, head_dim, block_size, torch.float32)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_matches_reference(group, block_size, head_dim):
    out, ref = run_prefill(PREFILL_SEQS, group, head_dim, block_size, torch.float32)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("head_dim", [32, 80, 96])
def test_padded_head_dims(head_dim):
    out, ref = run_decode(DECODE_SEQ_LENS, 3, head_dim, 16, torch.float32)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    out, ref = run_prefill(PREFILL_SEQS, 3, head_dim, 16, torch.float32)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches(dtype):
    out, ref = run_decode(DECODE_SEQ_LENS, 3, 64, 16, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    out, ref = run_prefill(PREFILL_SEQS, 3, 64, 16, dtype)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_16_bit_caches_under_a_float32_query(cache_dtype):
    """`--kv-cache-dtype float16|bfloat16` under a float32 model: tiles widened to float32 as loaded, scales ignored,
    the result as close to the reference (which widens the same values) as a float32 cache's."""
    scales = dict(k_scale=0.5, v_scale=3.0)
    out, ref = run_decode(DECODE_SEQ_LENS, 3, 64, 16, torch.float32, cache_dtype, **scales)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    out, ref = run_prefill(PREFILL_SEQS, 3, 64, 16, torch.float32, cache_dtype, **scales)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_caches_with_scales(cache_dtype, dtype):
    """fp8 caches hold value / scale: the kernels dequantize the tiles they load and apply both scales."""
    scales = dict(k_scale=0.5, v_scale=3.0)
    out, ref = run_decode(DECODE_SEQ_LENS, 3, 64, 16, dtype, cache_dtype, **scales)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    unscaled, _ = run_decode(DECODE_SEQ_LENS, 3, 64, 16, dtype, cache_dtype)
    assert not torch.allclose(out.float(), unscaled.float(), atol=0.5)  # the scales change the result
    out, ref = run_prefill(PREFILL_SEQS, 3, 64, 16, dtype, cache_dtype, **scales)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("block_size", [8, 24])
def test_other_block_sizes(block_size):
    # Key tiles gather each key's block from the table, so blocks smaller than a tile work too.
    out, ref = run_decode(DECODE_SEQ_LENS, 3, 64, block_size, torch.float32)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    out, ref = run_prefill(PREFILL_SEQS, 3, 64, block_size, torch.float32)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


def test_prefill_spanning_several_query_tiles():
    # With no GQA a tile holds 64 query tokens, so 70 new tokens need two tiles.
    out, ref = run_prefill([(70, 70), (23, 5)], 1, 64, 16, torch.float32)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


def test_single_token():
    out, ref = run_decode([1], 3, 64, 16, torch.float32)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    out, ref = run_prefill([(1, 1)], 3, 64, 16, torch.float32)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    # Attending to a single token returns its value exactly, per query head of the group.
    cache = make_paged_cache([1], NUM_KV_HEADS, 64, 16, torch.float32)
    query = torch.randn(1, NUM_KV_HEADS * 3, 64)
    out = paged_attention_decode(query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)
    expected = cache.values[0].repeat_interleave(3, dim=1)
    torch.testing.assert_close(out, expected)


def test_sequences_with_nothing_to_attend():
    # A zero-length sequence in a decode batch yields zeros; a zero-query sequence in prefill is skipped.
    out, ref = run_decode([0, 20], 3, 64, 16, torch.float32)
    assert torch.all(out[0] == 0)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    out, ref = run_prefill([(20, 4), (30, 0), (9, 9)], 3, 64, 16, torch.float32)
    assert out.shape[0] == 13
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("an empty batch must not launch a kernel")


def test_empty_batches_do_not_launch(monkeypatch):
    monkeypatch.setattr(paged_attention, "_decode_kernel", _NoLaunch())
    monkeypatch.setattr(paged_attention, "_prefill_kernel", _NoLaunch())
    cache = make_paged_cache([5], NUM_KV_HEADS, 64, 16, torch.float32)
    query = torch.empty(0, NUM_KV_HEADS * 3, 64)
    empty_lens = torch.empty(0, dtype=torch.int32)
    out = paged_attention_decode(query, cache.k_cache, cache.v_cache, cache.block_tables[:0], empty_lens, 0.1)
    assert out.shape == (0, NUM_KV_HEADS * 3, 64)
    query_start_loc = torch.zeros(2, dtype=torch.int32)
    out = paged_attention_prefill(
        query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, 0.1
    )
    assert out.shape == (0, NUM_KV_HEADS * 3, 64)


def test_non_contiguous_query_from_fused_qkv():
    group, head_dim = 3, 64
    cache = make_paged_cache(DECODE_SEQ_LENS, NUM_KV_HEADS, head_dim, 16, torch.float32)
    q_size = NUM_KV_HEADS * group * head_dim
    qkv = torch.randn(len(DECODE_SEQ_LENS), q_size + 2 * NUM_KV_HEADS * head_dim)
    query = qkv[:, :q_size].view(-1, NUM_KV_HEADS * group, head_dim)
    assert not query.is_contiguous()
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)
    out = paged_attention_decode(query, *args)
    torch.testing.assert_close(out, paged_attention_decode_ref(query.contiguous(), *args), atol=1e-4, rtol=1e-4)


def test_references_agree_with_dense_sdpa():
    """The paged references equal plain causal SDPA over contiguous K/V (their own check)."""
    group, head_dim = 3, 64
    cache = make_paged_cache([30], NUM_KV_HEADS, head_dim, 16, torch.float32)
    query = torch.randn(30, NUM_KV_HEADS * group, head_dim)
    query_start_loc = torch.tensor([0, 30], dtype=torch.int32)
    paged = paged_attention_prefill_ref(
        query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, 0.125
    )
    dense = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        cache.keys[0].transpose(0, 1),
        cache.values[0].transpose(0, 1),
        is_causal=True,
        scale=0.125,
        enable_gqa=True,
    ).transpose(0, 1)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)
    # Decode of the last token is the last row of the causal prefill.
    last = paged_attention_decode_ref(
        query[-1:], cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125
    )
    torch.testing.assert_close(last[0], dense[-1], atol=1e-5, rtol=1e-5)
