"""Speculative decoding end to end in one process: the real Scheduler planning, plans through the msgpack codec, the
real Worker verifying n-gram drafts in one forward. Greedy (and seeded) outputs with speculation are
token-identical to those without it, under chunked prefill, prefix caching and forced preemption.

The default model runs with its weights dequantized to float32 (quantization="none"): the kept-quantized GGUF
kernels quantize activations, so a multi-token step and a one-token step round differently and near ties flip
(measured: logits differ by up to ~1.4 between the two paths) - batch-variance that is not speculation's doing.
Without speculation, greedy float32 outputs match transformers (tests/engine/test_greedy_vs_transformers.py), so
matching them here means matching transformers too.
"""

from __future__ import annotations

import pytest

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir
from tests.helpers.spec_decode_runs import CODE, RUNNER_BLOCKS, generate
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from tokenmill.messages import EngineRequest, SamplingParams
from tokenmill.workers.worker import Worker

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)


def make_runner(model: ModelConfig) -> Worker:
    runner = Worker(
        EngineConfig(
            model=model,
            cache=CacheConfig(block_size=16, num_kv_blocks=RUNNER_BLOCKS),
            parallel=ParallelConfig(device="cpu"),
        )
    )
    runner.load_model()
    runner.allocate_kv_cache(RUNNER_BLOCKS)
    return runner


def compare(runner: Worker, requests, *, num_blocks: int, budget: int):
    plain, plain_scheduler = generate(
        runner, SpeculativeConfig(), requests, num_blocks=num_blocks, budget=budget, tag="plain"
    )
    spec, spec_scheduler = generate(runner, NGRAM, requests, num_blocks=num_blocks, budget=budget, tag="spec")
    assert spec == plain
    return plain, spec_scheduler.stats(), plain_scheduler.stats()


@pytest.fixture(scope="module")
def smollm2_runner():
    return make_runner(
        ModelConfig(path=str(smollm2_dir()), gguf_file=SMOLLM2_GGUF, dtype="float32", quantization="none")
    )


def test_default_model_greedy_identical_under_chunking_prefix_caching_and_preemption(smollm2_runner):
    from tests.helpers.checkpoints import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    copy = tokenizer.encode(f"Copy this code exactly, then stop.\n\n{CODE}\nCopy:\n")
    quote = tokenizer.encode(f"{CODE}\nQuote the line that raises an error, word for word:\n")
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
    requests = [
        (0, EngineRequest(request_id="copy", prompt_token_ids=copy, sampling=greedy)),
        # arrives once the first prompt is cached: hits its blocks
        (4, EngineRequest(request_id="seeded", prompt_token_ids=copy, sampling=seeded)),
        (4, EngineRequest(request_id="quote", prompt_token_ids=quote, sampling=greedy)),
    ]
    # 32-token budget: prompts are chunked; 9 blocks of 16 for three ~75-token prompts growing by 20: preemption
    outputs, spec_stats, plain_stats = compare(smollm2_runner, requests, num_blocks=9, budget=32)
    assert all(len(tokens) > 0 for tokens in outputs.values())
    assert spec_stats.spec_num_drafts > 0
    assert 0 < spec_stats.spec_num_accepted_tokens < spec_stats.spec_num_draft_tokens  # accepted and rejected
    assert spec_stats.num_preemptions > 0 and plain_stats.num_preemptions > 0
    assert spec_stats.prefix_cache_hits > 0


def test_tiny_checkpoint_greedy_identical(tiny_checkpoints):
    runner = make_runner(ModelConfig(path=str(tiny_checkpoints("qwen2")), dtype="float32"))
    prompt = [(i * 7) % 50 + 100 for i in range(40)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = [
        (0, EngineRequest(request_id="a", prompt_token_ids=prompt, sampling=greedy)),
        (0, EngineRequest(request_id="b", prompt_token_ids=prompt[5:] + prompt[:5], sampling=greedy)),
    ]
    _, spec_stats, _ = compare(runner, requests, num_blocks=32, budget=2048)
    assert spec_stats.spec_num_drafts > 0
