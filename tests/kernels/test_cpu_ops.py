"""The compiled CPU kernels (`kernels/cpu_ops.cpp`) against the torch code they replace, and how they are built."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.kernels_testutil import make_paged_cache
from tokenmill.kernels import cpu_ops
from tokenmill.kernels.paged_attention import paged_attention_decode_ref
from tokenmill.workers.attention import write_kv_torch
from tokenmill.workers.models.layers import RMSNorm, RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert cpu_ops.library() is not None, "the CPU kernels did not build (see the warning in the log)"


@pytest.fixture
def threads():
    """`threads(n)` sets torch's (and so the kernels') OpenMP thread count until the test ends."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# (query heads, kv heads, head dim): SmolLM2's GQA 3 at the specialized 64, MHA and GQA 8 at the specialized 128,
# and the general path at 80 and 32.
HEAD_SHAPES = [(9, 3, 64), (8, 8, 128), (16, 2, 128), (4, 2, 80), (6, 3, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", [16, 5, 32])
def test_decode_attention_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    seq_lens = [1, 15, 16, 17, 33, 100, 64]  # one token, partial, exact and multi-block, 16-key runs and tails
    cache = make_paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    cpu_ops.decode_attention(
        out, query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, head_dim**-0.5
    )
    expected = paged_attention_decode_ref(
        query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, head_dim**-0.5
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("num_seqs", [1, 3, 8])  # fewer sequences than 2 x threads: a work item per key chunk
def test_decode_attention_any_thread_count_and_work_split(threads, num_threads, num_seqs):
    threads(num_threads)
    assert cpu_ops.library().tm_omp_max_threads() == num_threads  # one OpenMP runtime, shared with torch
    seq_lens = [7 + 29 * i for i in range(num_seqs)]
    cache = make_paged_cache(seq_lens, 3, 64, 16, torch.float32)
    query = torch.randn(num_seqs, 9, 64)
    out = torch.empty_like(query)
    cpu_ops.decode_attention(
        out,
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        torch.arange(num_seqs + 1, dtype=torch.int32),
        cache.seq_lens,
        0.125,
    )
    expected = paged_attention_decode_ref(
        query, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_attention_gives_a_sequence_the_same_bits_alone_or_batched_at_any_thread_count(threads, cache_dtype):
    """A sequence decoded alone on two threads has its key chunks computed on both and merged; in a batch of eight, or
    on one thread, each sequence's chunks run in one work item. The same bits either way (batch invariance)."""
    seq_lens = [300, 5, 64, 65, 130, 17, 250, 1]
    cache = make_paged_cache(seq_lens, 3, 64, 16, torch.float32)
    k_cache, v_cache = cache.k_cache.to(cache_dtype), cache.v_cache.to(cache_dtype)
    query = torch.randn(len(seq_lens), 9, 64)

    def decode(rows: list[int]) -> torch.Tensor:
        out = torch.empty(len(rows), 9, 64)
        cpu_ops.decode_attention(
            out,
            query[rows].contiguous(),
            k_cache,
            v_cache,
            cache.block_tables[rows].contiguous(),
            torch.arange(len(rows) + 1, dtype=torch.int32),
            cache.seq_lens[rows].contiguous(),
            0.125,
        )
        return out

    results = []
    for num_threads in (1, 2):
        threads(num_threads)
        batched = decode(list(range(len(seq_lens))))
        results += [batched[[0, 6]], torch.cat([decode([0]), decode([6])])]
    for other in results[1:]:
        assert torch.equal(other, results[0])
    expected = paged_attention_decode_ref(query, k_cache, v_cache, cache.block_tables, cache.seq_lens, 0.125)
    torch.testing.assert_close(results[0], expected[[0, 6]], atol=2e-5, rtol=2e-5)


def test_decode_attention_leaves_prompt_rows_and_reads_a_strided_query():
    """A mixed batch: sequences of 3 and 2 query tokens around single-token ones; the query is a view of qkv."""
    seq_lens = [20, 9, 40, 33]
    query_lens = [1, 3, 1, 2]
    cache = make_paged_cache(seq_lens, 2, 64, 16, torch.float32)
    qkv = torch.randn(sum(query_lens), 8 * 64 + 2 * 2 * 64)
    query = qkv[:, : 8 * 64].view(-1, 8, 64)
    query_start_loc = torch.tensor([0, 1, 4, 5, 7], dtype=torch.int32)
    out = torch.full((sum(query_lens), 8, 64), -7.0)
    cpu_ops.decode_attention(
        out, query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens, 0.125
    )
    decode_rows, decode_seqs = [0, 4], [0, 2]
    expected = paged_attention_decode_ref(
        query[decode_rows].contiguous(),
        cache.k_cache,
        cache.v_cache,
        cache.block_tables[decode_seqs],
        cache.seq_lens[decode_seqs],
        0.125,
    )
    torch.testing.assert_close(out[decode_rows], expected, atol=2e-5, rtol=2e-5)
    assert (out[[1, 2, 3, 5, 6]] == -7.0).all(), "rows of multi-token sequences must be left alone"


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_copies_rows_and_skips_padding_slots(dtype):
    k_cache = torch.zeros(6, 4, 2, 64, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(4, 4 * 2 * 64).to(dtype)
    key = qkv[:, : 2 * 64].view(4, 2, 64)
    value = qkv[:, 2 * 64 : 4 * 64].view(4, 2, 64)
    slots = torch.tensor([9, -1, 22, 3])
    cpu_ops.write_kv(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    kept = slots >= 0
    write_kv_torch(key[kept], value[kept], expected_k, expected_v, slots[kept])
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fp8_conversions_are_torchs_bit_for_bit(fp8_dtype):
    """Every byte decodes as torch decodes it; floats (random bit patterns, values around the fp8 range, ties,
    subnormals, overflow, infinities, NaN) encode as torch's `.to(fp8)` does: nearest even, e4m3 saturating at 448."""
    every_byte = torch.arange(256, dtype=torch.uint8).view(fp8_dtype)
    decoded, expected = cpu_ops.fp8_convert(every_byte, False, fp8_dtype), every_byte.float()
    assert torch.equal(decoded.isnan(), expected.isnan())
    assert torch.equal(decoded.nan_to_num().view(torch.int32), expected.nan_to_num().view(torch.int32))

    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (1 << 18,), generator=generator, dtype=torch.int64).to(torch.int32)
    magnitudes = torch.exp2(torch.randint(-26, 18, (1 << 18,), generator=generator).float())
    near_range = torch.randn(1 << 18, generator=generator) * magnitudes
    halfway = (every_byte.float()[:-1] + every_byte.float()[1:]) / 2  # ties between neighbouring codes
    special = torch.tensor(
        [
            0.0,
            448.0,
            464.0,
            465.0,
            480.0,
            500.0,
            57344.0,
            61439.0,
            61440.0,
            65536.0,
            1e30,
            float("inf"),
            float("nan"),
            2.0**-6,
            2.0**-9,
            2.0**-10,
            3 * 2.0**-11,
            2.0**-14,
            2.0**-16,
            2.0**-17,
            3 * 2.0**-18,
            1e-30,
        ]
    )
    for floats in (random_bits.view(torch.float32), near_range, halfway.nan_to_num(), special, -special):
        encoded = cpu_ops.fp8_convert(floats, True, fp8_dtype)
        assert torch.equal(encoded.view(torch.uint8), floats.to(fp8_dtype).view(torch.uint8))


# (activations, cache): fp8 under either activation type; a 16-bit float cache under float32 activations
NARROWER_CACHES = [(dtype, fp8) for dtype in (torch.float32, torch.bfloat16) for fp8 in FP8_DTYPES] + [
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("dtype, cache_dtype", NARROWER_CACHES)
def test_write_kv_into_narrower_caches_matches_the_torch_code(dtype, cache_dtype):
    """fp8 stores key / k_scale rounded as torch does; a 16-bit cache ignores the scales and rounds as `.to()`."""
    k_cache = torch.zeros(24, 4, 2, 64, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = (torch.randn(80, 4 * 2 * 64) * 30).to(dtype)  # 80 tokens: the threaded loop; some keys past 448
    key = qkv[:, : 2 * 64].view(80, 2, 64)
    value = qkv[:, 2 * 64 : 4 * 64].view(80, 2, 64)
    slots = torch.randperm(24 * 4)[:80]
    slots[::7] = -1
    cpu_ops.write_kv(key, value, k_cache, v_cache, slots, k_scale=0.25, v_scale=3.0)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    kept = slots >= 0
    write_kv_torch(key[kept], value[kept], expected_k, expected_v, slots[kept], k_scale=0.25, v_scale=3.0)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [*FP8_DTYPES, torch.float16, torch.bfloat16])
def test_decode_attention_reads_every_cached_value_as_torch_converts_it(cache_dtype):
    """Four one-token sequences: each output row is its one value row, converted exactly (the weight is 1). For fp8
    the rows hold all 256 bytes (subnormals, the largest finites, NaN); for 16-bit caches random bit patterns."""
    bits_dtype = torch.uint8 if cache_dtype in FP8_DTYPES else torch.int16
    if bits_dtype == torch.uint8:
        bits = torch.arange(256, dtype=torch.uint8)
    else:
        bits = torch.randint(-(2**15), 2**15, (256,), dtype=torch.int32).to(torch.int16)
    cache = torch.zeros(5, 16, 1, 64, dtype=cache_dtype)
    cache.view(bits_dtype)[1:, 0, 0, :] = bits.view(4, 64)
    out = torch.empty(4, 1, 64)
    seq_lens = torch.ones(4, dtype=torch.int32)
    tables = torch.arange(1, 5, dtype=torch.int32)[:, None]
    query_start_loc = torch.arange(5, dtype=torch.int32)
    keys = torch.zeros_like(cache)  # one key a sequence: its weight is 1 whatever its score (a NaN key's would not)
    cpu_ops.decode_attention(out, torch.randn(4, 1, 64), keys, cache, tables, query_start_loc, seq_lens, 0.125)
    torch.testing.assert_close(out[:, 0], cache[1:, 0, 0].float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype, cache_dtype", NARROWER_CACHES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 2, 80)])
def test_decode_attention_over_narrower_caches_matches_reference(dtype, cache_dtype, num_heads, num_kv_heads, head_dim):
    seq_lens = [1, 17, 100, 64]
    cache = make_paged_cache(seq_lens, num_kv_heads, head_dim, 16, cache_dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    args = (cache.k_cache, cache.v_cache, cache.block_tables)
    cpu_ops.decode_attention(out, query, *args, query_start_loc, cache.seq_lens, head_dim**-0.5, None, 0.5, 3.0)
    expected = paged_attention_decode_ref(query, *args, cache.seq_lens, head_dim**-0.5, k_scale=0.5, v_scale=3.0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_layer(dtype, with_residual):
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(576)).to(dtype)
    x = (3 * torch.randn(32, 576)).to(dtype)
    residual = torch.randn(32, 576).to(dtype) if with_residual else None
    out, new_residual = cpu_ops.rms_norm(x, norm.weight, norm.eps, residual)
    expected_residual = x + residual if with_residual else x
    expected = norm.normalize(expected_residual)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    if not with_residual:
        assert new_residual is x  # as the layer: no residual in, x is the residual out


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_qkv_views_matches_the_layer(dtype):
    rotary = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 100000.0}, 2048)
    num_tokens, heads, kv_heads = 12, 9, 3
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * 64).to(dtype)
    q = qkv[:, : heads * 64].view(num_tokens, heads, 64)
    k = qkv[:, heads * 64 : (heads + kv_heads) * 64].view(num_tokens, kv_heads, 64)
    v_before = qkv[:, (heads + kv_heads) * 64 :].clone()
    positions = torch.tensor([0, 1, 2, 7, 100, 2047, 5, 5, 9, 1000, 3, 64])
    cos, sin = rotary.cos_sin(positions, dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out_q, out_k = cpu_ops.rotary(q, k, positions, rotary.cos_sin_table())
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q.float(), expected_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k.float(), expected_k.float(), atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * 64 :], v_before), "values must not move"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    x = (4 * torch.randn(32, 2 * 1536)).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-8, -1e-8, 88.0, -90.0]).to(dtype)  # saturation and zero
    expected = F.silu(x[:, :1536]) * x[:, 1536:]
    out = cpu_ops.silu_and_mul(x)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    built = cpu_ops.build()
    assert built.parent == tmp_path and built.exists()

    def no_compiler(*args, **kwargs):
        raise AssertionError("a cached build must not run the compiler")

    monkeypatch.setattr(cpu_ops.subprocess, "run", no_compiler)
    assert cpu_ops.build() == built
    assert not list(tmp_path.glob("*.partial")), "no partial build may be left behind"


def test_a_machine_without_a_compiler_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    from tokenmill.workers import attention, backends

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_ops.build()
    cpu_ops.library.cache_clear()
    backends.device_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenmill.kernels.cpu_ops"):
            assert cpu_ops.library() is None
            assert isinstance(backends.attention_backend("cpu"), attention.TorchAttentionBackend)
            assert backends.layer_ops("cpu") == backends.TORCH_OPS
        assert "using the slower torch code" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_ops.library.cache_clear()
        backends.device_kernels.cache_clear()
    assert cpu_ops.library() is not None


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_ops, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="could not build broken.cpp: .*error"):
        cpu_ops.build()
    assert not list((tmp_path / "cache").glob("*")), "a failed build leaves nothing in the cache"


def test_an_unsupported_dtype_is_refused_not_misread():
    x = torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="unsupported dtype torch.float64"):
        cpu_ops.silu_and_mul(x)


def test_a_16_bit_cache_under_other_16_bit_activations_is_refused():
    k_cache = torch.zeros(4, 4, 2, 64, dtype=torch.float16)
    key = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported dtypes torch.bfloat16 with a torch.float16 KV cache"):
        cpu_ops.write_kv(key, key, k_cache, k_cache.clone(), torch.arange(3))


# ---------------------------------------------------------------- only a library this user built is loaded


@pytest.fixture
def load_spy(tmp_path, monkeypatch):
    """Builds copy the session's library instead of compiling; fresh private directories go under tmp_path; the
    paths `library()` hands to ctypes are recorded. Yields (that list, the session's library)."""
    good = cpu_ops.build()
    loaded: list[str] = []
    real_cdll = cpu_ops.ctypes.CDLL

    def fake_compile(args, **kwargs):
        shutil.copyfile(good, args[args.index("-o") + 1])
        return subprocess.CompletedProcess(args, 0, "", "")

    def spy_cdll(path, *args, **kwargs):
        loaded.append(path)
        return real_cdll(path, *args, **kwargs)

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(cpu_ops.tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(cpu_ops.subprocess, "run", fake_compile)
    monkeypatch.setattr(cpu_ops.ctypes, "CDLL", spy_cdll)
    cpu_ops.library.cache_clear()
    yield loaded, good
    monkeypatch.undo()
    cpu_ops.library.cache_clear()


def test_a_good_cached_library_is_loaded(tmp_path, monkeypatch, load_spy, caplog):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))
    loaded, _ = load_spy
    with caplog.at_level(logging.WARNING, logger="tokenmill.kernels.cpu_ops"):
        assert cpu_ops.library() is not None
    built = cache / cpu_ops.library_name("g++")
    assert (cache.stat().st_mode & 0o777) == 0o700, "the cache directory is created private"
    assert (built.stat().st_mode & 0o022) == 0
    assert loaded == [str(built)] and "refusing" not in caplog.text


@pytest.mark.parametrize("make_untrusted", ["library_mode_666", "cache_dir_mode_777", "cache_dir_owned_by_another"])
def test_an_untrusted_cache_is_refused_and_the_kernels_built_privately(
    tmp_path, monkeypatch, load_spy, caplog, make_untrusted
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))
    loaded, good = load_spy
    planted = cache / cpu_ops.library_name("g++")
    cache.mkdir(mode=0o700)
    shutil.copyfile(good, planted)
    if make_untrusted == "library_mode_666":
        planted.chmod(0o666)
    elif make_untrusted == "cache_dir_mode_777":
        planted.chmod(0o755)
        cache.chmod(0o777)
    else:
        real_stat = Path.stat
        monkeypatch.setattr(
            Path,
            "stat",
            lambda self, **kw: _owned_by(real_stat(self, **kw), 12345) if self == cache else real_stat(self, **kw),
        )
    with caplog.at_level(logging.WARNING, logger="tokenmill.kernels.cpu_ops"):
        assert cpu_ops.library() is not None
    assert len(loaded) == 1 and loaded[0] != str(planted)
    fresh = Path(loaded[0]).parent
    assert fresh.parent == tmp_path / "tmp" and (fresh.stat().st_mode & 0o777) == 0o700
    assert caplog.text.count("refusing the CPU kernel cache") == 1


def _owned_by(st: os.stat_result, uid: int) -> os.stat_result:
    fields = list(st)
    fields[4] = uid  # st_uid
    return os.stat_result(fields)
