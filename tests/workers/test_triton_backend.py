"""The CUDA path on CPU: the Triton backend (KV write, decode/prefill attention, RMSNorm, rotary) and the decode
CUDA-graph runner, run through the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) by letting
`attention_backend` pick the kernels for "cpu". A GPU runs exactly this code with real kernels and real graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.reference import assert_greedy_match, hf_greedy_reference
from tests.helpers.runner_driver import logits_in_chunks, run_greedy
from tests.helpers.triton_runner import BLOCK_SIZE, CHUNKS, NUM_BLOCKS, make_runner
from tokenmill.workers import backends, worker
from tokenmill.workers.attention import build_attention_metadata
from tokenmill.workers.capture_plan import plan_cuda_graphs
from tokenmill.workers.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tokenmill.workers.triton_backend import TritonAttentionBackend


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Make `attention_backend("cpu")` the Triton backend for the test's duration."""
    monkeypatch.setattr(backends, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    backends.device_kernels.cache_clear()
    yield
    backends.device_kernels.cache_clear()


def eager_capture(forward):
    """A stand-in for `cuda_graph_capture`: "replay" reruns the forward into the same output buffer."""
    output = forward()
    eager_capture.replays = 0

    def replay() -> None:
        eager_capture.replays += 1
        output.copy_(forward())

    return replay, output


def test_cpu_runs_the_cpu_kernels_or_torch_unless_asked(use_cpu_backend):
    use_cpu_backend("kernels")  # the default where the kernels build
    use_cpu_backend("torch")  # TOKENMILL_CPU_KERNELS=0
    assert isinstance(backends.attention_backend("cuda"), TritonAttentionBackend)


def test_kernel_metadata_skips_the_sdpa_masks(triton_on_cpu):
    assert isinstance(backends.attention_backend("cpu"), TritonAttentionBackend)
    metadata = build_attention_metadata(
        np.array([3, 1]),
        np.array([5, 2]),
        np.array([[1, 2], [3, 0]]),
        4,
        torch.device("cpu"),
        backends.attention_backend("cpu"),
    )
    assert metadata.decode is None and metadata.prefills == []
    assert metadata.slot_mapping.tolist() == [6, 7, 8, 13]  # what the kernels do read is still there


@pytest.mark.parametrize("kind", ["llama", "llama-tied-mha", "qwen2", "qwen3"])
def test_kernel_path_logits_match_torch_path_and_hf(tiny_checkpoint, triton_on_cpu, kind):
    path, hf_model = tiny_checkpoint(kind)
    runner = make_runner(path)
    input_ids = torch.randint(3, hf_model.config.vocab_size, (CHUNKS[-1],), generator=torch.Generator().manual_seed(5))
    kernel_logits = logits_in_chunks(runner.model, input_ids, CHUNKS, BLOCK_SIZE)
    backends.device_kernels.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backends, "TRITON_DEVICE_TYPES", frozenset({"cuda"}))
        torch_logits = logits_in_chunks(runner.model, input_ids, CHUNKS, BLOCK_SIZE)
    backends.device_kernels.cache_clear()
    with torch.no_grad():
        hf_logits = hf_model(input_ids[None]).logits[0]
    torch.testing.assert_close(kernel_logits, torch_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel_logits, hf_logits, atol=1e-4, rtol=1e-4)


def test_padded_graph_batch_writes_and_returns_what_an_eager_step_does(tiny_checkpoint, triton_on_cpu):
    path, _ = tiny_checkpoint("llama")
    runner = make_runner(path)
    for k_cache, v_cache in runner.kv_caches:  # stale but finite contents, as a busy cache holds
        k_cache.normal_()
        v_cache.normal_()
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, [1, 2, 4], 128 // BLOCK_SIZE, BLOCK_SIZE, runner.device, eager_capture
    )
    # three sequences decoding at positions 6, 9 and 13 (their earlier tokens are whatever the cache holds)
    seq_lens = np.array([7, 10, 14])
    block_tables = np.array([[5, 9, 0, 0], [1, 2, 3, 0], [40, 41, 42, 43]])
    attn = build_attention_metadata(
        np.ones(3, dtype=np.int64), seq_lens, block_tables, BLOCK_SIZE, runner.device, backends.attention_backend("cpu")
    )
    input_ids = torch.tensor([11, 22, 33])
    positions = torch.from_numpy(seq_lens - 1)
    assert graphs.can_run(attn) and graphs.padded_size(3) == 4
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    with torch.inference_mode():
        expected = runner.model(input_ids, positions, attn, runner.kv_caches)
        eager_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        for (k, v), (k0, v0) in zip(runner.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        got = graphs.run(input_ids, positions, attn)
    assert eager_capture.replays == 1 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for (k, v), (k_eager, v_eager) in zip(runner.kv_caches, eager_caches):  # the padding row wrote nothing
        assert torch.equal(k, k_eager) and torch.equal(v, v_eager)
    assert not graphs.can_run(
        build_attention_metadata(
            np.array([2]), np.array([2]), np.array([[1]]), BLOCK_SIZE, runner.device, graphs.attention
        )
    )  # prefill runs eagerly


def test_runner_greedy_through_decode_graphs_matches_hf(tiny_checkpoint, triton_on_cpu, monkeypatch):
    path, hf_model = tiny_checkpoint("qwen3")
    runner = make_runner(path, max_num_seqs=4)
    # capture_cuda_graphs as on a GPU, with the eager stand-in for graph capture
    monkeypatch.setattr(runner, "capture_plan", lambda: plan_cuda_graphs(runner.config, "cuda", 1, 1))
    monkeypatch.setattr(worker, "cuda_graph_capture", lambda device, split_at_collectives: eager_capture)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    runner.capture_cuda_graphs()
    assert runner.decode_graphs.batch_sizes == [1, 2, 4]
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 12, 3)]
    max_new_tokens = 8
    # staggered arrivals and chunked prefill give mixed (eager) steps and decode batches of 1, 2 and 3 (padded to 4)
    outputs = run_greedy(runner, prompts, max_new_tokens, num_blocks=NUM_BLOCKS, chunk_size=4, arrival_steps=[0, 2, 4])
    assert eager_capture.replays > 0
    hf_model.generation_config.eos_token_id = None
    for ours, prompt in zip(outputs, prompts):
        assert len(ours) == max_new_tokens
        assert_greedy_match(ours, hf_greedy_reference(hf_model, prompt, max_new_tokens))


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_batch_sizes(1024)[-1] == 512
