"""Split-KV decode attention against its float64 reference, and the split-count rule.

Coverage under the interpreter (kept small: it runs kernels as numpy): contexts 0, 1, tile and partition edges
(31/32/33, 63/64/65), non-multiples of the block size, 4096 and 8192 (batch 1, one kv head); batch 1 to 64; GQA
groups 1, 3, 4 and 8 (rows padded to 16); 1 to 16 splits, more splits than tiles; block sizes 16 and
24; sliding windows across partitions; fp8 e4m3/e5m2 caches with k/v scales; fp32, fp16 and bf16 queries.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kernels_testutil import make_paged_cache
from tokenmill.kernels import split_kv_decode as split_kv
from tokenmill.kernels.paged_attention import paged_attention_decode
from tokenmill.kernels.split_kv_decode import choose_num_splits, decode_rows, split_kv_decode, split_kv_decode_ref

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
H100_SMS = 132
EDGE_SEQ_LENS = [1, 31, 32, 33, 63, 64, 65, 100, 0]  # one token, tile/partition edges, empty, not multiples of 16


def run(
    seq_lens,
    group,
    num_splits,
    dtype=torch.float32,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    cache_dtype=None,
    **kwargs,
):
    cache = make_paged_cache(seq_lens, num_kv_heads, head_dim, block_size, cache_dtype or dtype)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, head_dim**-0.5)
    out = split_kv_decode(*args, num_splits=num_splits, **kwargs)
    assert out.dtype == dtype and out.shape == query.shape
    return out, split_kv_decode_ref(*args, **kwargs).to(dtype)


def test_split_count_rule():
    # A batch that fills the SMs once needs no split, whatever its context.
    assert choose_num_splits(32, 8, 8192, H100_SMS) == 1
    assert choose_num_splits(256, 8, 1024, H100_SMS) == 1
    # Batch 1, 8 kv heads: ~two programs per SM at 8k (33 by SMs, 32 by 256-key partitions), fewer at 1k.
    assert choose_num_splits(1, 8, 8192, H100_SMS) == 32
    assert choose_num_splits(1, 8, 1024, H100_SMS) == 4
    assert choose_num_splits(4, 2, 100_000, H100_SMS) == 33
    assert choose_num_splits(1, 1, 1_000_000, H100_SMS) == 64  # capped
    # Short contexts and empty batches are never split.
    assert choose_num_splits(1, 8, 200, H100_SMS) == 1
    assert choose_num_splits(0, 8, 8192, H100_SMS) == 1
    assert choose_num_splits(1, 8, 0, H100_SMS) == 1


def test_rows_are_padded_to_the_dot_minimum():
    assert decode_rows(1) == 16  # MHA: tl.dot's smallest tile
    assert decode_rows(3) == 16
    assert decode_rows(8) == 16
    assert decode_rows(24) == 32


@pytest.mark.parametrize("group, num_splits", [(1, 1), (1, 16), (3, 3), (4, 5), (8, 1), (8, 16)])
def test_partition_edges_match_float64_reference(group, num_splits):
    out, ref = run(EDGE_SEQ_LENS, group, num_splits)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    assert torch.all(out[-1] == 0)  # the empty sequence


@pytest.mark.parametrize("seq_len, num_splits", [(4096, 11), (8192, 32)])
def test_long_contexts(seq_len, num_splits):
    out, ref = run([seq_len], 4, num_splits, num_kv_heads=1)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


def test_batch_of_64_with_mixed_lengths():
    seq_lens = torch.randint(1, 80, (64,), generator=torch.Generator("cpu").manual_seed(0), device="cpu").tolist()
    out, ref = run(seq_lens, 1, 2, num_kv_heads=1, block_size=24)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("window", [1, 40, 100])
def test_sliding_window_across_partitions(group, window):
    out, ref = run([1, 39, 41, 130, 257], group, 4, block_size=24, sliding_window=window)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 8])
def test_half_precision(dtype, group):
    out, ref = run([1, 45, 200], group, 3, dtype)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_16_bit_caches_under_a_float32_query(cache_dtype):
    out, ref = run([1, 45, 200], 8, 3, torch.float32, cache_dtype=cache_dtype, k_scale=0.5, v_scale=3.0)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])  # the scales ignored, as the reference does


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("group", [1, 8])
def test_fp8_caches_with_scales(cache_dtype, group):
    scales = dict(k_scale=0.5, v_scale=3.0)
    out, ref = run([1, 45, 200], group, 3, torch.bfloat16, cache_dtype=cache_dtype, **scales)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.bfloat16])
    torch.manual_seed(0)
    unscaled, _ = run([1, 45, 200], group, 3, torch.bfloat16, cache_dtype=cache_dtype)
    assert not torch.allclose(out.float(), unscaled.float(), atol=0.5)  # the scales change the result


@pytest.mark.parametrize("group", [1, 8])
def test_same_result_as_the_unsplit_kernel(group):
    cache = make_paged_cache([70, 5, 129], 2, 64, 16, torch.float32)
    query = torch.randn(3, 2 * group, 64)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)
    old = paged_attention_decode(*args)
    for num_splits in (1, 5):
        torch.testing.assert_close(split_kv_decode(*args, num_splits=num_splits), old, atol=2e-5, rtol=2e-5)


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("this kernel must not be launched")


def test_one_split_writes_the_output_without_a_reduce(monkeypatch):
    monkeypatch.setattr(split_kv, "_split_kv_reduce_kernel", _NoLaunch())
    out, ref = run([1, 70], 3, 1)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


def test_empty_batch_launches_nothing(monkeypatch):
    monkeypatch.setattr(split_kv, "_split_kv_partial_kernel", _NoLaunch())
    cache = make_paged_cache([5], 2, 64, 16, torch.float32)
    query = torch.empty(0, 6, 64)
    out = split_kv_decode(
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables[:0],
        torch.empty(0, dtype=torch.int32),
        0.1,
        num_splits=4,
    )
    assert out.shape == (0, 6, 64)


def test_non_contiguous_query_from_fused_qkv():
    cache = make_paged_cache([33, 90], 2, 64, 16, torch.float32)
    qkv = torch.randn(2, 6 * 64 + 2 * 2 * 64)
    query = qkv[:, : 6 * 64].view(2, 6, 64)
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)
    out = split_kv_decode(query, *args, num_splits=3)
    torch.testing.assert_close(out, split_kv_decode_ref(query.contiguous(), *args).float(), atol=2e-5, rtol=2e-5)


def test_rejects_a_split_count_below_one():
    cache = make_paged_cache([3], 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        split_kv_decode(
            torch.randn(1, 2, 64), cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.1, num_splits=0
        )
