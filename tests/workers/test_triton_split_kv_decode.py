"""The Triton backend's decode path: decode-only steps run the split-KV kernel with the split count the rule picks
from the step's host-side shapes and the device's SMs (the interpreter on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.kernels import split_kv_decode as split_kv
from tokenmill.kernels.paged_attention import paged_attention_prefill
from tokenmill.workers import triton_backend
from tokenmill.workers.attention import AttentionLayer, build_attention_metadata
from tokenmill.workers.triton_backend import TritonAttentionBackend, paged_attention_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # real Triton on a GPU, else interpreted
BLOCK_SIZE = 16
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 4, 32


def decode_step(seq_lens: list[int]):
    """A decode-only step's metadata over shuffled blocks, random caches and one query per sequence."""
    blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = blocks_per_seq * len(seq_lens)
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).view(len(seq_lens), -1)
    metadata = build_attention_metadata(
        np.ones(len(seq_lens), dtype=np.int64),
        np.array(seq_lens),
        tables.numpy().astype(np.int32),
        BLOCK_SIZE,
        DEVICE,
        TritonAttentionBackend(),
    )
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    query = torch.randn(len(seq_lens), NUM_KV_HEADS * GROUP, HEAD_DIM, device=DEVICE)
    return query, k_cache, v_cache, metadata


@pytest.fixture
def splits_used(monkeypatch):
    """The split count of every split-KV launch the test makes."""
    counts: list[int] = []
    kernel = split_kv.split_kv_decode

    def counting(*args, **kwargs):
        counts.append(args[6])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "split_kv_decode", counting)
    return counts


@pytest.mark.parametrize("window", [None, 300])
def test_decode_steps_split_long_contexts_and_match_the_prefill_kernel(monkeypatch, splits_used, window):
    monkeypatch.setattr(triton_backend, "device_sm_count", lambda device: 132)
    query, k_cache, v_cache, metadata = decode_step([700, 9])
    assert metadata.is_decode_only
    out = paged_attention_triton(query, k_cache, v_cache, metadata, AttentionLayer(HEAD_DIM**-0.5, window))
    # 2 sequences x 2 kv heads on 132 SMs: split to ~2 programs an SM, at most one split per 256 visible keys
    assert splits_used == [3 if window is None else 2]
    # A decode token is also a one-query prefill sequence: the prefill kernel gives the same attention.
    expected = paged_attention_prefill(
        query,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        HEAD_DIM**-0.5,
        window,
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_batches_that_fill_the_device_are_not_split(monkeypatch, splits_used):
    monkeypatch.setattr(triton_backend, "device_sm_count", lambda device: 4)
    query, k_cache, v_cache, metadata = decode_step([700, 9])
    paged_attention_triton(query, k_cache, v_cache, metadata, AttentionLayer(HEAD_DIM**-0.5))
    assert splits_used == [1]


def test_cpu_devices_use_the_interpreter_sm_count():
    assert triton_backend.device_sm_count(torch.device("cpu")) == triton_backend.INTERPRETER_SM_COUNT
