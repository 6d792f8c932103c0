"""The memory profile's worst-case step includes the sample stage (issue 26, item 5): the profiled peak, read from a
stand-in allocator that counts live tensor bytes on CPU, covers what the sampler itself holds at its worst."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.live_bytes import LiveBytes
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig
from tokenmill.messages import SamplingParams
from tokenmill.workers.sample_profile import WorstCaseSampling
from tokenmill.workers.sampler import RequestSamplingState, sample
from tokenmill.workers.worker import Worker

MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 128


def profile_config(path: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=path, max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_SEQS),
        server=ServerConfig(max_logprobs=20, max_logit_bias=1024),
        parallel=ParallelConfig(device="cpu"),
    )


@pytest.fixture
def cuda_stats_from(monkeypatch):
    """`cuda_stats_from(live)`: torch.cuda's peak statistics (and the calls around them) read from `live`."""

    def install(live: LiveBytes) -> None:
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: live.reset_peak())
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: live.peak)

    return install


def sampler_alone_peak(vocab_size: int) -> int:
    """The live bytes at the peak of sampling MAX_NUM_SEQS rows with every option on (the logits included), built
    here from SamplingParams rather than from the profile's own helper."""
    params = SamplingParams(
        top_k=vocab_size - 1,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={token_id: 0.5 for token_id in range(vocab_size)},
        logprobs=20,
    )
    history = [position % vocab_size for position in range(MAX_MODEL_LEN)]
    states = []
    for _ in range(MAX_NUM_SEQS):
        state = RequestSamplingState(params, history[: MAX_MODEL_LEN // 2], [0], "cpu")
        state.output_token_ids = history[MAX_MODEL_LEN // 2 :]
        states.append(state)
    with torch.inference_mode(), LiveBytes() as live:
        logits = torch.randn(MAX_NUM_SEQS, vocab_size)
        sample(logits, states)
        del logits
    return live.peak


def test_profiled_peak_covers_the_sampler_at_its_worst(tiny_checkpoint, cuda_stats_from):
    path, _ = tiny_checkpoint("llama")
    worker = Worker(profile_config(str(path)))
    worker.load_model()
    with LiveBytes() as live:
        cuda_stats_from(live)
        profiled = worker._profile_peak_memory()  # the weights predate the counter: activations only
    sampler = sampler_alone_peak(worker.vocab_size)
    assert profiled >= sampler, f"the profile's peak ({profiled} B) misses the sampler's ({sampler} B)"
    assert worker.profiled_step is not None and worker.profiled_step.sampler_bytes > 0
    assert worker.kv_cache is not None and worker.kv_cache.layers == []  # the dummy cache is released


def test_worst_case_takes_the_engine_limits(tiny_checkpoint):
    config = profile_config("unused")
    worst = WorstCaseSampling.from_config(config, vocab_size=320, max_model_len=MAX_MODEL_LEN)
    params = worst.sampling_params()
    assert (worst.num_seqs, worst.history_len, worst.prompt_logprobs_rows) == (MAX_NUM_SEQS, MAX_MODEL_LEN, 32)
    assert params.logprobs == params.prompt_logprobs == 20
    assert 0 < params.top_k < 320 and params.top_p < 1 and params.min_p > 0
    assert params.logit_bias is not None and len(params.logit_bias) == 320  # --max-logit-bias, within the vocabulary
    requests = worst.requests([0], torch.device("cpu"))
    assert len(requests) == MAX_NUM_SEQS
    state = requests[0].sampling
    assert state is not None and len(state.prompt_token_ids) + len(state.output_token_ids) == MAX_MODEL_LEN
    assert worst.grammar_plan(requests).grammar_bitmask == b"\xff" * (4 * 10 * MAX_NUM_SEQS)


def test_the_kernels_warm_up_over_the_dummy_cache_before_the_budget_is_read(
    tiny_checkpoint, cuda_stats_from, monkeypatch
):
    """The warm-up's memory outside torch (kernel images, local memory) must be gone from the free memory the KV
    budget starts from: it runs inside the profile, over the dummy cache."""
    path, _ = tiny_checkpoint("llama")
    worker = Worker(profile_config(str(path)))
    worker.load_model()
    warmed_with_blocks: list[int] = []
    real_warm_up = worker.warm_up_kernels

    def warm_up() -> None:
        assert worker.kv_cache is not None
        warmed_with_blocks.append(len(worker.kv_cache.layers))
        real_warm_up()

    monkeypatch.setattr(worker, "warm_up_kernels", warm_up)
    with LiveBytes() as live:
        cuda_stats_from(live)
        worker._profile_peak_memory()
    assert len(warmed_with_blocks) == 1 and warmed_with_blocks[0] > 0  # during the profile, its dummy cache held
