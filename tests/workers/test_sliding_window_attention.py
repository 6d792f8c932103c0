"""`paged_attention` with `AttentionLayer(sliding_window=w)` on the CPU backends (torch reference and compiled kernels)
against dense attention with transformers' sliding-window mask (q - w < k <= q), in decode, prefill, chunked and mixed
batches. Blocks wholly before a sequence's window hold NaN (as a block the scheduler freed may hold anything): no path
may read them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.workers.attention import AttentionLayer, build_attention_metadata, paged_attention

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 96
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


def dense_window_reference(query, keys, values, scale, window):
    q_len, seq_len = query.shape[0], keys.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    q_idx = torch.arange(seq_len - q_len, seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    allowed = kv_idx <= q_idx
    if window is not None:
        allowed &= kv_idx > q_idx - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).float()


def run_case(query_lens, seq_lens, window, decode_chunk_tokens=None, seed=0, prepared_windows=()):
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    k_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = [int(b) for b in rng.permutation(NUM_BLOCKS) if b != 0]
    k_cache[0] = v_cache[0] = 0.0  # table padding
    block_tables = np.zeros((len(seq_lens), max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1), dtype=np.int64)
    queries, new_keys, new_values, histories = [], [], [], []
    for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        block_tables[b, : len(blocks)] = blocks
        first_visible = max(0, seq_len - q_len - window + 1) if window is not None else 0
        for i, block in enumerate(blocks):
            if (i + 1) * BLOCK_SIZE > first_visible:  # blocks in the window: zeroed when handed out
                k_cache[block] = v_cache[block] = 0.0
        keys = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        values = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        cached = seq_len - q_len
        for pos in range(first_visible - first_visible % BLOCK_SIZE, cached):
            slot = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot] = keys[pos]
            v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot] = values[pos]
        histories.append((keys, values))
        queries.append(torch.randn(q_len, NUM_HEADS, HEAD_DIM, generator=generator))
        new_keys.append(keys[cached:])
        new_values.append(values[cached:])
    from tokenmill.workers.backends import attention_backend

    meta = build_attention_metadata(
        np.array(query_lens),
        np.array(seq_lens),
        block_tables,
        BLOCK_SIZE,
        CPU,
        attention_backend("cpu"),
        decode_chunk_tokens,
        prepared_windows,
    )
    scale = HEAD_DIM**-0.5
    out = paged_attention(
        torch.cat(queries),
        torch.cat(new_keys),
        torch.cat(new_values),
        (k_cache, v_cache),
        AttentionLayer(scale, window),
        meta,
    )
    expected = torch.cat([dense_window_reference(q, k, v, scale, window) for q, (k, v) in zip(queries, histories)])
    return out, expected


CASES = [
    ([1, 1, 1, 1], [1, 7, 9, 33]),  # decode only
    ([5, 9, 16], [5, 9, 16]),  # whole prompts
    ([4, 3, 13], [13, 30, 40]),  # chunks after cached prefixes
    ([1, 6, 1, 3, 1], [17, 6, 2, 12, 40]),  # mixed decode and prefill
]


@pytest.mark.parametrize("window", [1, 3, 4, 5, 9, 16, 64])
@pytest.mark.parametrize("query_lens, seq_lens", CASES)
@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_sliding_window_matches_dense(use_cpu_backend, backend, query_lens, seq_lens, window):
    use_cpu_backend(backend)
    out, expected = run_case(query_lens, seq_lens, window)
    assert torch.isfinite(out).all(), "a block before the window was read"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("decode_chunk_tokens", [1, 16, 48])
def test_sliding_window_in_decode_chunks(use_cpu_backend, decode_chunk_tokens):
    use_cpu_backend("torch")
    out, expected = run_case([1] * 7, [3, 16, 17, 5, 40, 9, 9], 6, decode_chunk_tokens, seed=1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_windows_prepared_with_the_step_give_the_same_attention(use_cpu_backend, backend):
    """The model's windows are precomputed in prepare (the worker passes them); a window prepare was not told of is
    built during the forward. Both read the same keys."""
    use_cpu_backend(backend)
    for query_lens, seq_lens in CASES:
        prepared, expected = run_case(query_lens, seq_lens, 5, 16, prepared_windows=(5, 9))
        on_the_fly, _ = run_case(query_lens, seq_lens, 5, 16)
        torch.testing.assert_close(prepared, expected, atol=1e-5, rtol=1e-4)
        assert torch.equal(prepared, on_the_fly)


def test_prepare_precomputes_each_window_the_step_reaches_past(use_cpu_backend):
    backend = use_cpu_backend("torch")
    block_tables = np.arange(1, 1 + 3 * 3).reshape(3, 3)
    meta = build_attention_metadata(
        np.array([1, 1, 6]), np.array([3, 9, 10]), block_tables, BLOCK_SIZE, CPU, backend, None, (4, 32)
    )
    assert [sorted(chunk.windowed) for chunk in meta.decode.chunks] == [[4]]  # 9 keys: past 4, not past 32
    assert [sorted(seq.windowed) for seq in meta.prefills] == [[4]]


def test_no_window_is_full_causal_attention_and_a_window_changes_it(use_cpu_backend):
    use_cpu_backend("torch")
    out_full, expected_full = run_case([1, 6, 1], [17, 6, 30], None)
    torch.testing.assert_close(out_full, expected_full, atol=1e-5, rtol=1e-4)
    out_local, expected_local = run_case([1, 6, 1], [17, 6, 30], 5)
    torch.testing.assert_close(out_local, expected_local, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(out_local, out_full, atol=1e-3)


def test_a_non_positive_window_is_refused(use_cpu_backend):
    use_cpu_backend("torch")
    with pytest.raises(ValueError, match="sliding_window"):
        run_case([1], [5], 0)


def test_layer_windows_follow_transformers_configs():
    from transformers import MistralConfig, Qwen2Config

    from tokenmill.workers.models.llama import LlamaForCausalLM, MistralForCausalLM, layer_sliding_windows

    tiny = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=4,
    )
    mistral = MistralForCausalLM(MistralConfig(sliding_window=24, **tiny))
    assert [layer.self_attn.attn_layer.sliding_window for layer in mistral.model.layers] == [24] * 4
    assert mistral.kv_sliding_window == 24
    assert MistralForCausalLM(MistralConfig(sliding_window=None, **tiny)).kv_sliding_window is None
    # Qwen2: only with use_sliding_window, and then the layers from max_window_layers on
    assert layer_sliding_windows(Qwen2Config(sliding_window=32, **tiny)) == [None] * 4
    mixed = Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=2, **tiny)
    assert layer_sliding_windows(mixed) == [None, None, 32, 32]
    model = LlamaForCausalLM(mixed)
    assert [layer.self_attn.attn_layer.sliding_window for layer in model.model.layers] == [None, None, 32, 32]
    assert model.kv_sliding_window is None  # a global layer keeps every block
    everywhere = Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=0, **tiny)
    assert LlamaForCausalLM(everywhere).kv_sliding_window == 32
