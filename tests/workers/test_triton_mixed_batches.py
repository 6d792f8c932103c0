"""Mixed steps on the Triton backend (interpreted on CPU): a step's decode tokens go through the split-KV decode
kernel and its prefill chunks through the prefill kernel, in one forward, the batch ordered decode-first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.reference import assert_greedy_match, hf_greedy_reference
from tests.helpers.runner_driver import run_greedy
from tests.helpers.triton_runner import NUM_BLOCKS, force_triton_on_cpu, make_runner
from tokenmill.kernels.paged_attention import paged_attention_prefill_ref
from tokenmill.messages import NewRequestData, RunningRequestData, SamplingParams, StepPlan
from tokenmill.workers import backends, triton_backend
from tokenmill.workers.attention import AttentionLayer, build_attention_metadata
from tokenmill.workers.request_state import RequestStates
from tokenmill.workers.triton_backend import TritonAttentionBackend, paged_attention_triton

BLOCK_SIZE = 4
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 2, 16
SCALE = HEAD_DIM**-0.5


@pytest.fixture
def triton_on_cpu(monkeypatch):
    force_triton_on_cpu(monkeypatch)
    yield
    backends.device_kernels.cache_clear()


@pytest.fixture
def kernel_rows(monkeypatch):
    """Per kernel kind, the query rows of every launch the Triton backend makes."""
    rows: dict[str, list[int]] = {"decode": [], "prefill": []}
    decode, prefill = triton_backend.split_kv_decode, triton_backend.paged_attention_prefill

    def counting_decode(query, *args, **kwargs):
        rows["decode"].append(query.shape[0])
        return decode(query, *args, **kwargs)

    def counting_prefill(query, *args, **kwargs):
        rows["prefill"].append(query.shape[0])
        return prefill(query, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "split_kv_decode", counting_decode)
    monkeypatch.setattr(triton_backend, "paged_attention_prefill", counting_prefill)
    return rows


def attend(query_lens: list[int], seq_lens: list[int]):
    """One layer of attention over random caches and shuffled blocks: (Triton output, float reference, metadata)."""
    generator = torch.Generator().manual_seed(3)
    blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = blocks_per_seq * len(seq_lens)
    tables = torch.randperm(num_blocks, generator=generator).view(len(seq_lens), -1).numpy()
    metadata = build_attention_metadata(
        np.array(query_lens), np.array(seq_lens), tables, BLOCK_SIZE, torch.device("cpu"), TritonAttentionBackend()
    )
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    out = paged_attention_triton(query, k_cache, v_cache, metadata, AttentionLayer(SCALE))
    args = (metadata.block_tables, metadata.query_start_loc, metadata.seq_lens, SCALE)
    return out, paged_attention_prefill_ref(query, k_cache, v_cache, *args), metadata


def test_a_mixed_steps_decode_rows_run_the_decode_kernel(kernel_rows):
    out, expected, metadata = attend([1, 1, 1, 5, 3], [40, 9, 1, 12, 3])
    assert metadata.mixed is not None and metadata.mixed.num_decode_seqs == 3
    assert metadata.mixed.prefill_query_start_loc.tolist() == [0, 5, 8]
    assert kernel_rows == {"decode": [3], "prefill": [8]}  # one launch each, on its own rows only
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("query_lens", "kernels"),
    [([1, 1], {"decode": [2], "prefill": []}), ([4, 2], {"decode": [], "prefill": [6]})],
)
def test_uniform_steps_run_one_kernel(kernel_rows, query_lens, kernels):
    out, expected, metadata = attend(query_lens, [17, 6])
    assert metadata.mixed is None and kernel_rows == kernels
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_a_decode_after_a_prefill_is_left_to_the_prefill_kernel(kernel_rows):
    """Only a leading run of decodes is split off; a batch in another order is still right, just not split."""
    out, expected, metadata = attend([1, 3, 1], [7, 5, 22])
    assert metadata.mixed is not None and metadata.mixed.num_decode_seqs == 1
    assert kernel_rows == {"decode": [1], "prefill": [4]}
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_a_plan_is_applied_decode_first():
    params = SamplingParams(temperature=0.0, max_tokens=4)
    states = RequestStates([], torch.device("cpu"))
    states.apply(StepPlan(0, [NewRequestData("a", [5, 6, 7], 3, params, [0], 0, 3)], [], []), lambda blocks: None)
    plan = StepPlan(
        1,
        [NewRequestData("b", [1, 2], 2, params, [1], 0, 2), NewRequestData("c", [3], 1, params, [2], 0, 1)],
        [RunningRequestData("a", [8], [], 3, 1)],
        [],
    )
    scheduled = states.apply(plan, lambda blocks: None)
    # the one-token requests (a running decode, a one-token prompt) first, each group in plan order
    assert [entry.request.request_id for entry in scheduled] == ["c", "a", "b"]


def test_mixed_steps_through_the_triton_backend_are_greedy_identical_to_hf(tiny_checkpoint, triton_on_cpu, monkeypatch):
    mixed_steps: list[int] = []
    split = triton_backend.mixed_batch_split

    def recording_split(step):
        found = split(step)
        if found is not None:
            mixed_steps.append(found.num_decode_seqs)
        return found

    monkeypatch.setattr(triton_backend, "mixed_batch_split", recording_split)
    path, hf_model = tiny_checkpoint("llama")
    runner = make_runner(path, max_num_seqs=4)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=generator).tolist() for n in (3, 5, 17)]
    max_new_tokens = 6
    # staggered arrivals with 4-token chunks: later prompts prefill in chunks while earlier requests decode
    outputs = run_greedy(runner, prompts, max_new_tokens, num_blocks=NUM_BLOCKS, chunk_size=4, arrival_steps=[0, 1, 3])
    assert len(mixed_steps) >= 3 and max(mixed_steps) == 2  # mixed steps with one and two decodes ran split
    hf_model.generation_config.eos_token_id = None
    for ours, prompt in zip(outputs, prompts):
        assert len(ours) == max_new_tokens
        assert_greedy_match(ours, hf_greedy_reference(hf_model, prompt, max_new_tokens))
