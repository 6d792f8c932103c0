"""Sliding-window attention in the Triton paged-attention kernels and the compiled CPU decode kernel.

Semantics as transformers' sliding-window mask: a query at position p sees keys p - window < k <= p. Every kernel is
compared with the torch references, which are themselves checked against a dense mask built the way transformers
builds it. Blocks wholly before a sequence's window are then replaced by a block of NaN keys and values: a kernel that
read them (rather than starting at the window) would return NaN, so the scheduler may free and reuse them.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kernels_testutil import make_paged_cache, poison_blocks_before_windows
from tokenmill.kernels import cpu_ops
from tokenmill.kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_prefill,
    paged_attention_prefill_ref,
)

NUM_KV_HEADS = 2
ATOL = RTOL = 1e-4
DECODE_SEQ_LENS = [1, 17, 45, 70, 33]
# (seq_len, q_len): a whole prompt, a decode token in the batch, chunks after a cached prefix
PREFILL_SEQS = [(37, 37), (50, 1), (45, 20), (81, 70)]
# smaller than every context, equal to one (17, 45, 70), larger than all, a single key, odd sizes
WINDOWS = [1, 7, 16, 17, 45, 70, 100]


def dense_hf_mask_attention(query, keys, values, query_positions, window, scale):
    """Attention with the mask transformers builds: causal AND kv_idx > q_idx - sliding_window."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    kv_idx = torch.arange(keys.shape[0])[None, :]
    q_idx = query_positions[:, None]
    allowed = (kv_idx <= q_idx) & (kv_idx > q_idx - window)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).float()


def test_references_match_the_transformers_mask():
    cache = make_paged_cache([40], NUM_KV_HEADS, 32, 16, torch.float32)
    query = torch.randn(12, NUM_KV_HEADS * 3, 32)
    query_start_loc = torch.tensor([0, 12], dtype=torch.int32)
    for window in (1, 5, 16, 40):
        ref = paged_attention_prefill_ref(
            query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, 0.2, window
        )
        dense = dense_hf_mask_attention(query, cache.keys[0], cache.values[0], torch.arange(28, 40), window, 0.2)
        torch.testing.assert_close(ref, dense, atol=1e-5, rtol=1e-5)
    # window 1: each query sees only its own key, so the output is its own value
    ref = paged_attention_prefill_ref(
        query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, 0.2, 1
    )
    torch.testing.assert_close(ref, cache.values[0][28:].repeat_interleave(3, dim=1))
    # a window covering the whole context is plain causal attention
    full = paged_attention_prefill_ref(
        query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, 0.2
    )
    wide = paged_attention_prefill_ref(
        query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, 0.2, 40
    )
    torch.testing.assert_close(wide, full)


def decode_case(window, block_size, group=3, head_dim=64, dtype=torch.float32):
    cache = make_paged_cache(DECODE_SEQ_LENS, NUM_KV_HEADS, head_dim, block_size, dtype)
    query = torch.randn(len(DECODE_SEQ_LENS), NUM_KV_HEADS * group, head_dim).to(dtype)
    ref = paged_attention_decode_ref(
        query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, head_dim**-0.5, window
    )
    poison_blocks_before_windows(cache, [max(0, n - window) for n in DECODE_SEQ_LENS], block_size)
    return cache, query, ref


@pytest.mark.parametrize("block_size", [16, 5, 32])
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_decode_window(window, block_size):
    cache, query, ref = decode_case(window, block_size)
    out = paged_attention_decode(
        query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 64**-0.5, window
    )
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("group", [1, 3])
def test_triton_prefill_window(window, block_size, group):
    seq_lens = [n for n, _ in PREFILL_SEQS]
    q_lens = torch.tensor([q for _, q in PREFILL_SEQS])
    cache = make_paged_cache(seq_lens, NUM_KV_HEADS, 64, block_size, torch.float32)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    query = torch.randn(int(q_lens.sum()), NUM_KV_HEADS * group, 64)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, 0.125, window)
    ref = paged_attention_prefill_ref(*args)
    first_queries = [n - q for n, q in PREFILL_SEQS]
    poison_blocks_before_windows(cache, [max(0, p - window + 1) for p in first_queries], block_size)
    out = paged_attention_prefill(*args)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    if window < 70:  # the window changes the answer (the check above is not plain causal attention by accident)
        full = paged_attention_prefill_ref(*args[:-1])
        assert not torch.allclose(full[-70:], ref[-70:], atol=1e-3)


def test_triton_window_none_is_full_attention():
    cache, query, _ = decode_case(1000, 16)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)
    torch.testing.assert_close(
        paged_attention_decode(*args, None), paged_attention_decode_ref(*args), atol=ATOL, rtol=RTOL
    )


CPU_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])  # the specialised and the general path
@pytest.mark.parametrize("block_size", [16, 5, 32])
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_decode_window(window, block_size, head_dim, dtype):
    assert cpu_ops.library() is not None, "the CPU kernels did not build"
    cache, query, ref = decode_case(window, block_size, head_dim=head_dim, dtype=dtype)
    out = torch.full_like(query, float("nan"))
    cpu_ops.decode_attention(
        out,
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        torch.arange(len(DECODE_SEQ_LENS) + 1, dtype=torch.int32),
        cache.seq_lens,
        head_dim**-0.5,
        window,
    )
    tol = CPU_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.cpu_kernel
@pytest.mark.parametrize("num_threads", [1, 2])
def test_cpu_decode_window_work_split_and_prefetch(num_threads):
    """Many sequences (one item each, prefetching the next item's window) and few (split by kv head)."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for seq_lens in ([7 + 29 * i for i in range(9)], [100, 3]):
            cache = make_paged_cache(seq_lens, 3, 64, 16, torch.float32)
            query = torch.randn(len(seq_lens), 9, 64)
            ref = paged_attention_decode_ref(
                query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125, 20
            )
            poison_blocks_before_windows(cache, [max(0, n - 20) for n in seq_lens], 16)
            out = torch.empty_like(query)
            cpu_ops.decode_attention(
                out,
                query,
                cache.k_cache,
                cache.v_cache,
                cache.block_tables,
                torch.arange(len(seq_lens) + 1, dtype=torch.int32),
                cache.seq_lens,
                0.125,
                20,
            )
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(before)
