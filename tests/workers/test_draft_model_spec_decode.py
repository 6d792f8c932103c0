"""Draft-model speculative decoding end to end in one process: the real Scheduler, plans through the msgpack codec,
the real Worker filling the draft model's KV, proposing greedily and verifying the drafts in one forward.
Greedy outputs with the draft model are token-identical to those without speculation, under chunked prefill,
prefix caching and forced preemption (float32 tiny checkpoints; see test_spec_decode_runner.py for why float32)."""

from __future__ import annotations

import os

import pytest

from tests.helpers.draft_checkpoints import write_first_layers_checkpoint
from tests.helpers.spec_decode_runs import RUNNER_BLOCKS, generate, requests
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from tokenmill.messages import EngineRequest, SamplingParams
from tokenmill.speculative import parse_speculative_config
from tokenmill.workers.worker import Worker


def draft_runner(target: str, draft: str, k: int = 4) -> tuple[Worker, SpeculativeConfig]:
    speculative = parse_speculative_config({"method": "draft_model", "model": draft, "num_speculative_tokens": k})
    runner = Worker(
        EngineConfig(
            model=ModelConfig(path=target, dtype="float32"),
            speculative=speculative,
            cache=CacheConfig(block_size=16, num_kv_blocks=RUNNER_BLOCKS),
            parallel=ParallelConfig(device="cpu"),
        )
    )
    runner.load_model()
    runner.allocate_kv_cache(RUNNER_BLOCKS)
    return runner, speculative


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tests.helpers.checkpoints import build_tiny_checkpoint, smollm2_tokenizer

    root = tmp_path_factory.mktemp("draft-spec")
    tokenizer = smollm2_tokenizer()
    target = build_tiny_checkpoint("llama", root, tokenizer)
    first_layer = write_first_layers_checkpoint(ModelConfig(path=str(target)), 1, root / "llama-first-layer", tokenizer)
    return str(target), str(first_layer), root


def test_identical_draft_is_accepted_and_greedy_output_unchanged(tiny_target):
    """The target as its own draft: every draft should be accepted; chunked prefill (24-token budget)."""
    target, _, _ = tiny_target
    runner, speculative = draft_runner(target, target)
    plain, plain_scheduler = generate(
        runner, SpeculativeConfig(), requests(30, False), num_blocks=32, budget=24, tag="p"
    )
    spec, spec_scheduler = generate(runner, speculative, requests(30, False), num_blocks=32, budget=24, tag="s")
    assert spec == plain
    stats = spec_scheduler.stats()
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens  # rounding may flip a near tie
    assert stats.spec_accepted_per_pos[3] > 0  # whole k-token drafts accepted: the lookahead KV was right
    assert stats.prefix_cache_hits > 0
    # fewer steps: several tokens per verification
    assert spec_scheduler._next_step_id < plain_scheduler._next_step_id


def test_first_layer_draft_greedy_identical_under_preemption(tiny_target):
    """A one-layer draft of the two-layer target: drafts accepted and rejected (a seeded request's sampled tokens
    rarely match greedy drafts); 9 blocks force preemption."""
    target, first_layer, _ = tiny_target
    runner, speculative = draft_runner(target, first_layer, k=3)
    plain, plain_scheduler = generate(runner, SpeculativeConfig(), requests(40, True), num_blocks=9, budget=32, tag="p")
    spec, spec_scheduler = generate(runner, speculative, requests(40, True), num_blocks=9, budget=32, tag="s")
    assert spec == plain
    stats = spec_scheduler.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.num_preemptions > 0


def test_draft_with_another_vocabulary_is_refused(tiny_target, tmp_path):
    import json
    import shutil

    target, first_layer, _ = tiny_target
    other = tmp_path / "other-vocab"
    shutil.copytree(first_layer, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 8
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary of .* the target's has .* must use the target's tokenizer"):
        draft_runner(target, str(other))


@pytest.mark.skipif(
    not os.environ.get("TOKENMILL_DRAFT_DEFAULT_MODEL"),
    reason="~5 min on 2 busy cores: set TOKENMILL_DRAFT_DEFAULT_MODEL=1 (the tiny checkpoints above run in CI)",
)
def test_default_model_with_its_first_layers_as_draft_greedy_identical(tmp_path):
    """The default model (float32) with a draft of its own first 24 of 30 layers: token-identical greedy output."""
    from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir, smollm2_tokenizer
    from tests.helpers.spec_decode_runs import CODE

    source = ModelConfig(path=str(smollm2_dir()), gguf_file=SMOLLM2_GGUF, dtype="float32", quantization="none")
    tokenizer = smollm2_tokenizer()
    draft = write_first_layers_checkpoint(source, 24, tmp_path / "smollm2-first-24", tokenizer)
    speculative = parse_speculative_config({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4})
    runner = Worker(
        EngineConfig(
            model=source,
            speculative=speculative,
            cache=CacheConfig(block_size=16, num_kv_blocks=RUNNER_BLOCKS),
            parallel=ParallelConfig(device="cpu"),
        )
    )
    runner.load_model()
    runner.allocate_kv_cache(RUNNER_BLOCKS)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [f"Rewrite this code with the function renamed to rect_area:\n{CODE}", "What is the capital of France?"]
    reqs = [
        (
            0,
            EngineRequest(
                request_id=str(i),
                prompt_token_ids=tokenizer.encode(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                    )
                ),
                sampling=greedy,
            ),
        )
        for i, p in enumerate(prompts)
    ]
    plain, _ = generate(runner, SpeculativeConfig(), reqs, num_blocks=RUNNER_BLOCKS, budget=48, tag="p")
    spec, scheduler = generate(runner, speculative, reqs, num_blocks=RUNNER_BLOCKS, budget=48, tag="s")
    assert spec == plain
    stats = scheduler.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
