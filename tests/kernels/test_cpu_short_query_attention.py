"""The compiled CPU attention kernel on sequences of a few query tokens (speculative-decoding verification steps,
short prompts) against a float64 reference, in batches that mix them with single-token decodes and with longer
prompts, which the kernel must leave alone.

Query i of a sequence of q_len queries and seq_len cached tokens sits at position seq_len - q_len + i and sees keys
[0, p] (with a sliding window, (p - window, p]). Blocks wholly before the earliest query's window are replaced by a
block of NaN keys and values, so a kernel that read them would return NaN.

Every test runs on the kernels as this machine builds them and as an AVX2 machine does (`TOKENMILL_CPU_ISA=avx2`):
the AVX2 build scores keys and sums values with code of its own.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cpu_isa import CPU_ISAS, use_cpu_kernels_built_for
from tests.helpers.kernels_testutil import make_paged_cache, poison_blocks_before_windows
from tokenmill.kernels import cpu_ops
from tokenmill.kernels.kv_quant import dequantize

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
LIMIT = 9  # max_query_len of the calls below: sequences of 1..9 queries are the kernel's
# (query tokens, cached tokens): decodes, verification steps of 2..9 tokens (past 16-key runs and block ends, a whole
# short prompt), and prompts longer than LIMIT, which stay untouched
BATCH = [
    (1, 37),
    (2, 2),
    (8, 208),
    (3, 17),
    (12, 40),
    (9, 33),
    (1, 1),
    (5, 100),
    (4, 64),
    (30, 30),
    (7, 71),
    (6, 16),
    (2, 50),
]
SENTINEL = -7.0


@pytest.fixture(autouse=True, params=CPU_ISAS)
def isa(request, monkeypatch):
    use_cpu_kernels_built_for(monkeypatch, request.param)
    assert cpu_ops.library() is not None, "the CPU kernels did not build (see the warning in the log)"
    return request.param


def reference(query, cache, batch, scale, window=None, k_scale=1.0, v_scale=1.0):
    """float64 attention of each sequence's queries over its own keys and values, masked as transformers does."""
    outputs = []
    start = 0
    for seq, (q_len, seq_len) in enumerate(batch):
        q = query[start : start + q_len].double()
        start += q_len
        group = q.shape[1] // cache.keys[seq].shape[1]
        keys = dequantize(cache.keys[seq], k_scale, torch.float64).repeat_interleave(group, dim=1)
        values = dequantize(cache.values[seq], v_scale, torch.float64).repeat_interleave(group, dim=1)
        diff = torch.arange(seq_len - q_len, seq_len)[:, None] - torch.arange(seq_len)[None, :]
        allowed = (diff >= 0) & (diff < (window or seq_len))
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(outputs)


def run(
    batch, num_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype=None, window=None, k_scale=1.0, v_scale=1.0
):
    """(kernel output, float64 reference, rows the kernel handles, reference without the window) of one batch;
    blocks before the windows are poisoned."""
    q_lens = [q for q, _ in batch]
    seq_lens = [n for _, n in batch]
    cache = make_paged_cache(seq_lens, num_kv_heads, head_dim, block_size, cache_dtype or dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    expected = reference(query, cache, batch, scale, window, k_scale, v_scale)
    unwindowed = expected if window is None else reference(query, cache, batch, scale, None, k_scale, v_scale)
    if window is not None:
        poison_blocks_before_windows(cache, [max(0, n - q - window + 1) for q, n in batch], block_size)
    query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    out = torch.full((sum(q_lens), num_heads, head_dim), SENTINEL, dtype=dtype)
    cpu_ops.decode_attention(
        out,
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        query_start_loc,
        cache.seq_lens,
        scale,
        window,
        k_scale,
        v_scale,
        max_query_len=LIMIT,
    )
    handled = torch.cat([torch.full((q,), q <= LIMIT) for q in q_lens])
    return out, expected, handled, unwindowed


def check(out, expected, handled, unwindowed, dtype):
    assert (out[~handled] == SENTINEL).all(), "rows of sequences longer than max_query_len must be left alone"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[handled].double(), expected[handled], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# SmolLM2's GQA 3 at the specialised 64, GQA 8 at the specialised 128, MHA on the general path
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (16, 2, 128), (4, 4, 80)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_short_queries_match_the_float64_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    check(*run(BATCH, num_heads, num_kv_heads, head_dim, block_size, dtype), dtype)


@pytest.mark.parametrize("window", [1, 3, 16, 17, 45, 1000])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [16, 5])
def test_sliding_window_reads_nothing_before_the_earliest_querys_window(window, head_dim, block_size):
    result = run(BATCH, 6, 2, head_dim, block_size, torch.float32, window=window)
    check(*result, torch.float32)
    out, _, handled, unwindowed = result
    if window < 45:  # the window changes the answer (the check above is not plain causal attention by accident)
        assert not torch.allclose(out[handled].double(), unwindowed[handled], atol=1e-3)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_fp8_caches_with_scales(dtype, cache_dtype, head_dim):
    check(*run(BATCH, 9, 3, head_dim, 16, dtype, cache_dtype, k_scale=0.5, v_scale=3.0), dtype)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("batch", [BATCH, [(8, 90)], [(8, 90), (1, 30)]])  # few sequences split items by kv head
@pytest.mark.parametrize("window", [None, 20])
def test_any_thread_count_and_work_split(num_threads, batch, window):
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        assert cpu_ops.library().tm_omp_max_threads() == num_threads
        check(*run(batch, 9, 3, 64, 16, torch.float32, window=window), torch.float32)
    finally:
        torch.set_num_threads(before)


def test_a_query_row_equals_decoding_that_token_alone():
    """Query i of a verification step is what a single-token decode at its position returns (same kernel path
    for its rows): the step's later keys are invisible to it."""
    cache = make_paged_cache([60], 3, 64, 16, torch.float32)
    query = torch.randn(8, 9, 64)
    out = torch.empty_like(query)
    cpu_ops.decode_attention(
        out,
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        torch.tensor([0, 8], dtype=torch.int32),
        cache.seq_lens,
        0.125,
        max_query_len=8,
    )
    for i in range(8):
        alone = torch.empty(1, 9, 64)
        cpu_ops.decode_attention(
            alone,
            query[i : i + 1],
            cache.k_cache,
            cache.v_cache,
            cache.block_tables,
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([53 + i], dtype=torch.int32),
            0.125,
        )
        torch.testing.assert_close(out[i : i + 1], alone, atol=1e-6, rtol=1e-6)


def test_max_query_len_one_is_the_decode_kernel():
    """The default max_query_len leaves every multi-token sequence alone, as the decode-only kernel did."""
    batch = [(1, 20), (3, 9), (1, 40), (2, 33)]
    cache = make_paged_cache([n for _, n in batch], 2, 64, 16, torch.float32)
    query = torch.randn(7, 8, 64)
    out = torch.full((7, 8, 64), SENTINEL)
    cpu_ops.decode_attention(
        out,
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        torch.tensor([0, 1, 4, 5, 7], dtype=torch.int32),
        cache.seq_lens,
        0.125,
    )
    expected = reference(query, cache, batch, 0.125)
    torch.testing.assert_close(out[[0, 4]].double(), expected[[0, 4]], atol=2e-5, rtol=2e-5)
    assert (out[[1, 2, 3, 5, 6]] == SENTINEL).all()
