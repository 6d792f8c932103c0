"""Recorded CPU verification steps (`workers/cpu_verify_graphs.py`): the same bits as the eager forward at every
shape, at positions and block tables unseen when recorded; the worker records them only with speculation on, and
greedy outputs with speculation on the kept-quantized default model equal those without it."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir, smollm2_tokenizer
from tests.helpers.spec_decode_runs import CODE, generate
from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenmill.kernels import cpu_ops
from tokenmill.messages import EngineRequest, SamplingParams
from tokenmill.scheduler import spec_decode
from tokenmill.workers import worker as worker_module
from tokenmill.workers.attention import build_attention_metadata
from tokenmill.workers.cpu_verify_graphs import (
    MAX_REPLAYED_SEQS,
    MAX_VERIFY_SEQS,
    MAX_VERIFY_TOKENS,
    CpuSpeculativeGraphs,
    CpuVerifyGraphs,
)
from tokenmill.workers.worker import Worker

BLOCK_SIZE = 16
NUM_BLOCKS = 64
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=7, prompt_lookup_min=3, prompt_lookup_max=5)


@pytest.fixture(autouse=True)
def cpu_kernels(use_cpu_backend):
    if cpu_ops.library() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    use_cpu_backend("kernels")


@pytest.fixture(scope="module")
def spec_worker() -> Worker:
    """The shipped SmolLM2 Q4_1 GGUF kept quantized, on the CPU kernels, n-gram speculation on (eager until
    `capture_cuda_graphs`; decode batches of 1 and 2 recorded then)."""
    worker = Worker(
        EngineConfig(
            model=ModelConfig(path=str(smollm2_dir()), gguf_file=SMOLLM2_GGUF),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS),
            scheduler=SchedulerConfig(max_num_seqs=2),
            parallel=ParallelConfig(device="cpu"),
            speculative=NGRAM,
        )
    )
    worker.load_model()
    worker.allocate_kv_cache(NUM_BLOCKS)
    return worker


def test_bounds_are_the_schedulers():
    """The recorded shapes cover every verification step the scheduler plans by default."""
    assert MAX_VERIFY_SEQS == spec_decode.MAX_SPECULATING_BATCH
    assert MAX_VERIFY_TOKENS == spec_decode.STEP_TOKEN_BUDGET


def test_recorded_verification_equals_the_eager_forward_bit_for_bit(spec_worker):
    worker = spec_worker
    rng = np.random.default_rng(5)
    with torch.inference_mode():
        graphs = CpuVerifyGraphs(
            worker.model,
            worker.kv_caches,
            8,
            BLOCK_SIZE,
            worker.text_config.hidden_size,
            worker.dtype,
            max_seqs=MAX_REPLAYED_SEQS,
        )
        # (3, 4): a prefill chunk of 2 beside two decodes; the last shape again: replayed, not recorded anew
        shapes = [(1, 2), (1, 8), (2, 5), (3, 4), (4, 8), (1, 2)]
        for num_seqs, num_tokens in shapes:
            query_lens = np.ones(num_seqs, dtype=np.int64)
            query_lens[rng.integers(num_seqs)] += num_tokens - num_seqs
            seq_lens = rng.integers(20, 120, num_seqs) + query_lens
            tables = rng.permutation(np.arange(1, NUM_BLOCKS))[: num_seqs * 8].reshape(num_seqs, 8)
            attn = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, worker.device, graphs.attention)
            assert graphs.can_run(attn)
            ids = torch.as_tensor(rng.integers(100, 20_000, num_tokens))
            positions = torch.as_tensor(np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]))
            caches = [(k.clone(), v.clone()) for k, v in worker.kv_caches]
            expected = worker.model(ids, positions, attn, worker.kv_caches)
            expected_caches = [(k.clone(), v.clone()) for k, v in worker.kv_caches]
            for (k, v), (k0, v0) in zip(worker.kv_caches, caches, strict=True):
                k.copy_(k0)
                v.copy_(v0)
            got = graphs.run(ids, positions, attn)
            assert torch.equal(got, expected), f"{num_tokens} tokens in {num_seqs} sequences"
            for (k, v), (k1, v1) in zip(worker.kv_caches, expected_caches, strict=True):
                assert torch.equal(k, k1) and torch.equal(v, v1)  # the same KV written, to the same slots
        assert graphs.recorded_shapes == [(1, 2), (1, 8), (2, 5), (3, 4), (4, 8)]


def test_chunks_beside_up_to_three_decoders_are_recorded_within_the_batch_bound(spec_worker):
    """Issue 28: an n = 2 request's second choice prefills beside its first choice and a bystander, a 3-sequence
    step, which ran eagerly at ~2x a decode step; with 4 sequences allowed a batch every shape of up to 4 sequences
    and 8 tokens is recorded at start-up, and with 2 only the 2-sequence ones."""
    worker = spec_worker
    max_blocks, hidden_size = 8, worker.text_config.hidden_size
    with torch.inference_mode():
        wide = CpuSpeculativeGraphs(
            worker.model, worker.kv_caches, [1, 2, 3, 4], max_blocks, BLOCK_SIZE, hidden_size, worker.dtype
        )
        narrow = CpuSpeculativeGraphs(
            worker.model, worker.kv_caches, [1, 2], max_blocks, BLOCK_SIZE, hidden_size, worker.dtype
        )
    assert MAX_REPLAYED_SEQS == 4 and wide.verify.max_seqs == 4 and narrow.verify.max_seqs == 2
    assert (3, 4) in wide.verify.recorded_shapes and len(wide.verify.recorded_shapes) == 22
    assert max(shape[0] for shape in narrow.verify.recorded_shapes) == 2 and len(narrow.verify.recorded_shapes) == 13


def test_steps_outside_the_bounds_are_left_to_the_eager_forward(spec_worker):
    worker = spec_worker
    hidden_size = worker.text_config.hidden_size
    graphs = CpuVerifyGraphs(worker.model, worker.kv_caches, 8, BLOCK_SIZE, hidden_size, worker.dtype)

    def metadata(query_lens: list[int], tables: int = 8):
        seq_lens = np.array(query_lens) + 30
        block_tables = np.arange(1, 1 + len(query_lens) * tables).reshape(len(query_lens), tables)
        return build_attention_metadata(
            np.array(query_lens), seq_lens, block_tables, BLOCK_SIZE, worker.device, graphs.attention
        )

    assert graphs.can_run(metadata([4, 4]))
    assert not graphs.can_run(metadata([1, 1]))  # decode: CpuDecodeGraphs' steps
    assert not graphs.can_run(metadata([5, 4]))  # 9 tokens
    assert not graphs.can_run(metadata([2, 2, 2]))  # 3 sequences
    assert not graphs.can_run(metadata([4], tables=9))  # a longer block table than the buffers hold
    assert graphs.recorded_shapes == []


def copy_requests() -> list[tuple[int, EngineRequest]]:
    tokenizer = smollm2_tokenizer()
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    copy = tokenizer.encode(f"Copy this code exactly, then stop.\n\n{CODE}\nCopy:\n")
    quote = tokenizer.encode(f"{CODE}\nQuote the line that raises an error, word for word:\n")
    return [
        (0, EngineRequest(request_id="copy", prompt_token_ids=copy, sampling=greedy)),
        (6, EngineRequest(request_id="quote", prompt_token_ids=quote, sampling=greedy)),  # batches of 1 and 2
    ]


def test_greedy_outputs_with_recorded_verification_equal_plain_decoding(spec_worker):
    worker = spec_worker
    worker.capture_cuda_graphs()
    graphs = worker.decode_graphs
    assert isinstance(graphs, CpuSpeculativeGraphs)
    replays: list[int] = []
    original_run = graphs.verify.run
    graphs.verify.run = lambda ids, *args: replays.append(len(ids)) or original_run(ids, *args)  # type: ignore[method-assign]
    requests = copy_requests()
    try:
        plain, _ = generate(worker, SpeculativeConfig(), requests, num_blocks=NUM_BLOCKS, budget=256, tag="plain")
        assert not replays
        spec, scheduler = generate(worker, NGRAM, requests, num_blocks=NUM_BLOCKS, budget=256, tag="spec")
    finally:
        worker.decode_graphs = None
        worker.forward = worker._choose_forward()
    assert spec == plain
    stats = scheduler.stats()
    # drafts accepted (on AVX-512 some are rejected too; an AVX2 host's greedy text copied the code exactly and
    # accepted all 29: rejection is covered by tests/workers/test_spec_decode_runner.py)
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    # every verification without a prompt chunk in its step replayed (one of them holds both requests' tokens)
    assert 0 < len(replays) <= stats.spec_num_drafts
    assert graphs.verify.recorded_shapes and max(replays) > 2


@pytest.mark.parametrize("speculative", [NGRAM, SpeculativeConfig()])
def test_short_multi_token_steps_are_recorded_with_or_without_speculation(spec_worker, monkeypatch, speculative):
    """Without speculation too: a small prefill chunk beside a decode has a verification's shape."""
    built: list[type] = []
    monkeypatch.setattr(worker_module, "CpuSpeculativeGraphs", lambda *args: built.append(CpuSpeculativeGraphs))
    monkeypatch.setattr(spec_worker, "config", msgspec.structs.replace(spec_worker.config, speculative=speculative))
    monkeypatch.setattr(spec_worker, "forward", None)
    spec_worker._record_cpu_graphs()
    assert built == [CpuSpeculativeGraphs]


def test_small_prefill_chunks_beside_decodes_replay_without_speculation(spec_worker, monkeypatch):
    """A budget of 8 tokens: every prompt goes in chunks of at most 8 (7 beside the other request's decode), each a
    verification-shaped step; recorded, the greedy outputs are the eager forward's."""
    worker = spec_worker
    monkeypatch.setattr(worker, "config", msgspec.structs.replace(worker.config, speculative=SpeculativeConfig()))
    requests = copy_requests()
    worker.decode_graphs, worker.forward = None, worker._choose_forward()
    eager, _ = generate(worker, SpeculativeConfig(), requests, num_blocks=NUM_BLOCKS, budget=8, tag="eager")
    worker.capture_cuda_graphs()
    graphs = worker.decode_graphs
    assert isinstance(graphs, CpuSpeculativeGraphs)
    replays: list[int] = []
    original_run = graphs.verify.run
    graphs.verify.run = lambda ids, *args: replays.append(len(ids)) or original_run(ids, *args)  # type: ignore[method-assign]
    try:
        recorded, _ = generate(worker, SpeculativeConfig(), requests, num_blocks=NUM_BLOCKS, budget=8, tag="rec")
    finally:
        worker.decode_graphs = None
        worker.forward = worker._choose_forward()
    assert recorded == eager
    assert len(graphs.verify.recorded_shapes) == 13, "every shape recorded at start-up, none in a live step"
    assert len(replays) > 10 and max(replays) == 8, "no 7-token prefill chunk replayed beside a decode"


def test_the_worker_reports_the_largest_replayed_step_to_the_scheduler(spec_worker, monkeypatch):
    """WorkerReady.replayed_step_*: the learnt prefill limit keeps small chunks within it (prefill_limit.py)."""
    monkeypatch.setattr(spec_worker, "decode_graphs", None)  # nothing recorded (a GPU, a model left eager)
    assert spec_worker.replayed_step == (0, 0)
    monkeypatch.setattr(spec_worker, "forward", None)
    spec_worker._record_cpu_graphs()
    assert isinstance(spec_worker.decode_graphs, CpuSpeculativeGraphs)
    assert spec_worker.replayed_step == (MAX_VERIFY_SEQS, MAX_VERIFY_TOKENS)
