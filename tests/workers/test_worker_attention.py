"""Paged attention on CPU against dense causal attention over each sequence's own keys and values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.kernels.kv_quant import dequantize, quantize
from tokenmill.workers.attention import (
    AttentionLayer,
    _decode_chunk_bounds,
    build_attention_metadata,
    paged_attention,
    token_positions,
    write_kv_torch,
)
from tokenmill.workers.backends import attention_backend

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 64
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8


def dense_reference(query, keys, values, scale):
    """query [q_len, Hq, D] at the last q_len positions of keys/values [seq_len, Hkv, D]."""
    q_len, seq_len = query.shape[0], keys.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys.double()) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double()).float()


def run_case(
    query_lens,
    seq_lens,
    seed=0,
    garbage=float("nan"),
    decode_chunk_tokens=None,
    cache_dtype=torch.float32,
    k_scale=1.0,
    v_scale=1.0,
):
    """Fill the cache for every sequence's history, then one step of new tokens; compare with dense attention.

    Unused cache slots hold `garbage`, as a torch.empty cache may. With an fp8 `cache_dtype` the cache holds keys /
    k_scale and values / v_scale, and the dense reference sees the keys and values as stored (rounded to fp8).
    """
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    k_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), garbage, dtype=cache_dtype)
    v_cache = torch.full_like(k_cache, garbage)
    free = [int(b) for b in rng.permutation(NUM_BLOCKS) if b != 0]
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1  # one spare column of padding
    block_tables = np.zeros((len(seq_lens), max_blocks), dtype=np.int64)
    histories, queries, new_keys, new_values = [], [], [], []
    for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        block_tables[b, : len(blocks)] = blocks
        # The runner's contract: a block is zeroed when first handed out, and block 0 (table padding) at once.
        # Every other block keeps the garbage, so reading outside the block tables would show.
        for block in [0, *blocks]:
            k_cache[block] = 0.0
            v_cache[block] = 0.0
        keys = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        values = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        stored_keys, stored_values = quantize(keys, k_scale, cache_dtype), quantize(values, v_scale, cache_dtype)
        histories.append(
            (dequantize(stored_keys, k_scale, torch.float32), dequantize(stored_values, v_scale, torch.float32))
        )
        cached = seq_len - q_len
        for pos in range(cached):  # what earlier steps stored
            slot = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot] = stored_keys[pos]
            v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot] = stored_values[pos]
        queries.append(torch.randn(q_len, NUM_HEADS, HEAD_DIM, generator=generator))
        new_keys.append(keys[cached:])
        new_values.append(values[cached:])

    meta = build_attention_metadata(
        np.array(query_lens),
        np.array(seq_lens),
        block_tables,
        BLOCK_SIZE,
        CPU,
        attention_backend("cpu"),
        decode_chunk_tokens,
    )
    scale = HEAD_DIM**-0.5
    out = paged_attention(
        torch.cat(queries),
        torch.cat(new_keys),
        torch.cat(new_values),
        (k_cache, v_cache),
        AttentionLayer(scale, k_scale=k_scale, v_scale=v_scale),
        meta,
    )
    expected = torch.cat([dense_reference(q, k, v, scale) for q, (k, v) in zip(queries, histories)])
    return out, expected, meta


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1, 1, 1, 1], [1, 7, 8, 33]),  # decode only, block-aligned and not
        ([5, 9, 16], [5, 9, 16]),  # whole prompts
        ([4, 3], [13, 30]),  # prompt chunks after cached prefixes
        ([1, 6, 1, 3, 1], [17, 6, 2, 12, 40]),  # mixed decode and prefill
        ([1, 20, 5, 1, 17], [17, 20, 12, 40, 30]),  # prompts past the CPU kernel's query limit beside short ones
    ],
)
@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_paged_attention_matches_dense(use_cpu_backend, backend, query_lens, seq_lens):
    use_cpu_backend(backend)
    out, expected, meta = run_case(query_lens, seq_lens)
    assert meta.is_decode_only == all(q == 1 for q in query_lens)
    assert torch.isfinite(out).all(), "garbage (NaN) cache slots leaked into the output"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_fp8_caches_store_and_read_with_the_layer_scales(use_cpu_backend, backend, cache_dtype):
    """Mixed decode and prefill over fp8 caches: this step's keys and values are quantized as earlier steps' were,
    every path reads them back times their scale (NaN garbage in unused fp8 slots stays out)."""
    use_cpu_backend(backend)
    query_lens, seq_lens = [1, 6, 1, 3, 1], [17, 6, 2, 12, 40]
    # scales no power of two, so that fp8 rounds the scaled values differently: a path that skipped a scale on
    # write or read would be off by far more than the tolerance
    out, expected, _ = run_case(query_lens, seq_lens, cache_dtype=cache_dtype, k_scale=0.3, v_scale=1.7)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1] * 7, [3, 16, 17, 5, 40, 9, 9]),  # decode only
        ([1, 6, 1, 1, 3, 1, 1], [17, 6, 2, 30, 12, 40, 8]),  # decode rows between prefills
    ],
)
@pytest.mark.parametrize("decode_chunk_tokens", [1, 16, 48])
def test_decode_chunks_match_dense(use_cpu_backend, query_lens, seq_lens, decode_chunk_tokens):
    use_cpu_backend("torch")  # decode chunks are the torch path's
    out, expected, meta = run_case(query_lens, seq_lens, seed=1, decode_chunk_tokens=decode_chunk_tokens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    chunks = meta.decode.chunks
    assert len(chunks) > 1
    decode_lens = [n for q, n in zip(query_lens, seq_lens) if q == 1]
    assert [c.start for c in chunks] == [0] + [c.end for c in chunks[:-1]] and chunks[-1].end == len(decode_lens)
    for chunk in chunks:
        lens = decode_lens[chunk.start : chunk.end]
        assert chunk.num_keys == max(lens)
        assert (chunk.key_mask is None) == (len(set(lens)) == 1)


def test_decode_chunk_bounds():
    padded = np.array([16, 16, 32, 16, 64, 16])
    assert _decode_chunk_bounds(padded, None) == [(0, 6)]
    # each chunk: sequences x its longest padded length <= 64; a longer sequence alone
    assert _decode_chunk_bounds(padded, 64) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert _decode_chunk_bounds(padded, 32) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert _decode_chunk_bounds(padded, 1) == [(i, i + 1) for i in range(6)]


def test_metadata_slots_positions_and_groups(use_cpu_backend):
    backend = use_cpu_backend("torch")
    block_tables = np.array([[7, 2, 0], [5, 0, 0], [9, 3, 4]])
    meta = build_attention_metadata(np.array([2, 1, 3]), np.array([6, 3, 11]), block_tables, BLOCK_SIZE, CPU, backend)
    # seq 0: positions 4, 5 -> block 2; seq 1: position 2 -> block 5; seq 2: positions 8, 9, 10 -> block 4
    assert meta.slot_mapping.tolist() == [8, 9, 22, 16, 17, 18]
    assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.dtype == torch.int32
    assert meta.query_start_loc.tolist() == [0, 2, 3, 6] and meta.seq_lens.tolist() == [6, 3, 11]
    assert not meta.is_decode_only and meta.max_query_len == 3 and meta.max_seq_len == 11
    assert meta.decode.token_indices.tolist() == [2]
    assert [(p.query_start, p.query_end, p.seq_len) for p in meta.prefills] == [(0, 2, 6), (3, 6, 11)]
    assert meta.prefills[1].block_ids.tolist() == [9, 3, 4]


def test_kernel_metadata_groups_only_sequences_past_the_kernels_query_limit(use_cpu_backend):
    """The CPU kernel attends sequences of up to max_kernel_query_len tokens (decodes, verification steps, short
    prompts); only longer ones get an SDPA group, and no decode chunks are built."""
    backend = use_cpu_backend("kernels")
    limit = backend.max_kernel_query_len
    assert limit >= 8, "a verification step of 1 + 7 draft tokens must fit the kernel"
    query_lens = np.array([2, 1, limit + 1, limit, 20])
    seq_lens = query_lens + np.array([4, 2, 0, 3, 5])
    block_tables = np.arange(1, 1 + 5 * 7).reshape(5, 7)
    meta = build_attention_metadata(query_lens, seq_lens, block_tables, BLOCK_SIZE, CPU, backend, 1)
    assert meta.decode is None and not meta.is_decode_only and meta.max_query_len == 20
    starts = (np.cumsum(query_lens) - query_lens).tolist()
    assert [(p.query_start, p.query_end, p.seq_len) for p in meta.prefills] == [
        (starts[2], starts[2] + limit + 1, limit + 1),
        (starts[4], starts[4] + 20, 25),
    ]


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_write_kv_through_the_backend_skips_nothing_and_touches_nothing_else(use_cpu_backend, backend):
    write_kv = use_cpu_backend(backend).write_kv
    k_cache = torch.zeros(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(3, 2 * NUM_KV_HEADS * HEAD_DIM)  # key and value as views of one fused row, as the model has
    key = qkv[:, : NUM_KV_HEADS * HEAD_DIM].view(3, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, NUM_KV_HEADS * HEAD_DIM :].view(3, NUM_KV_HEADS, HEAD_DIM)
    write_kv(key, value, k_cache, v_cache, torch.tensor([13, 2, 7]))
    flat_k, flat_v = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM), v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat_k[[13, 2, 7]], key, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[[13, 2, 7]], value, rtol=0, atol=0)
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 3 and int((flat_v.abs().sum((1, 2)) > 0).sum()) == 3


def test_write_kv_fills_exactly_the_slots():
    k_cache = torch.zeros(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    write_kv_torch(key, value, k_cache, v_cache, torch.tensor([13, 2, 7]))
    torch.testing.assert_close(k_cache[3, 1], key[0])
    torch.testing.assert_close(v_cache[0, 2], value[1])
    torch.testing.assert_close(k_cache[1, 3], key[2])
    assert int((k_cache.abs().sum(-1).sum(-1) > 0).sum()) == 3


@pytest.mark.parametrize("backend_name", ["kernels", "torch"])
def test_decode_only_metadata_takes_each_sequences_last_position(use_cpu_backend, backend_name):
    """A decode step (one query token per sequence, the shortcut's case) gets what the general formula gives."""
    backend = use_cpu_backend(backend_name)
    block_tables = np.array([[7, 2, 0], [5, 0, 0], [9, 3, 4], [1, 6, 8]])
    seq_lens = np.array([5, 3, 9, 8])
    meta = build_attention_metadata(np.ones(4, dtype=np.int64), seq_lens, block_tables, BLOCK_SIZE, CPU, backend)
    # positions 4, 2, 8, 7 -> blocks 2, 5, 4, 6
    assert meta.slot_mapping.tolist() == [2 * BLOCK_SIZE, 5 * BLOCK_SIZE + 2, 4 * BLOCK_SIZE, 6 * BLOCK_SIZE + 3]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.seq_lens.tolist() == seq_lens.tolist()
    assert meta.is_decode_only and meta.max_query_len == 1 and meta.prefills == []
    assert token_positions(np.ones(4), seq_lens).tolist() == [4, 2, 8, 7]
    assert token_positions(np.array([1, 2, 1]), np.array([5, 4, 9])).tolist() == [4, 2, 3, 8]
    empty = build_attention_metadata(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1)), 4, CPU, backend)
    assert empty.is_decode_only and empty.slot_mapping.numel() == 0 and empty.query_start_loc.tolist() == [0]
