"""Worker end to end on tiny random checkpoints: greedy generation through StepPlans equals HF generate."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.reference import assert_greedy_match, hf_greedy_reference
from tests.helpers.runner_driver import BLOCK_SIZE, NUM_BLOCKS, make_runner, run_greedy
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.messages import NewRequestData, RunningRequestData, SamplingParams, StepPlan
from tokenmill.workers.worker import Worker

MAX_NEW_TOKENS = 24
PROMPT_LENGTHS = [3, 11, 17, 30]


def prompts_for(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


_references: dict[tuple[int, tuple[tuple[int, ...], ...]], list] = {}


def references(model, prompts):
    """HF greedy references, computed once per (model, prompts) for the whole session."""
    key = (id(model), tuple(map(tuple, prompts)))
    if key not in _references:
        model.generation_config.eos_token_id = None  # compare full lengths: the runner never stops at EOS itself
        _references[key] = [hf_greedy_reference(model, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    return _references[key]


def assert_all_match(outputs, refs) -> None:
    compared = [assert_greedy_match(ours, ref) for ours, ref in zip(outputs, refs, strict=True)]
    assert all(len(ours) == MAX_NEW_TOKENS for ours in outputs)
    assert sum(compared) >= len(refs) * MAX_NEW_TOKENS // 2, f"too few tokens compared before near ties: {compared}"


@pytest.mark.parametrize("kind", ["llama", "llama-tied-mha", "llama3-rope", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("chunk_size", [None, 5], ids=["whole-prompts", "chunked-prefill"])
def test_greedy_generation_matches_hf(tiny_checkpoint, kind, chunk_size):
    path, hf_model = tiny_checkpoint(kind)
    runner = make_runner(path)
    prompts = prompts_for(hf_model.config.vocab_size)
    # Staggered arrivals mix prefills (or prompt chunks) with other requests' decode steps in one batch.
    outputs = run_greedy(
        runner, prompts, MAX_NEW_TOKENS, num_blocks=NUM_BLOCKS, chunk_size=chunk_size, arrival_steps=[0, 0, 2, 5]
    )
    assert_all_match(outputs, references(hf_model, prompts))


def test_sharded_checkpoint_generates_like_single_file(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("llama", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    runner = make_runner(path)
    prompts = prompts_for(hf_model.config.vocab_size)
    outputs = run_greedy(runner, prompts, MAX_NEW_TOKENS, num_blocks=NUM_BLOCKS)
    assert_all_match(outputs, references(hf_model, prompts))


def test_preempted_request_resumes_where_it_left_off(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("qwen2")
    runner = make_runner(path)
    prompts = prompts_for(hf_model.config.vocab_size)
    outputs = run_greedy(runner, prompts, MAX_NEW_TOKENS, num_blocks=NUM_BLOCKS, chunk_size=8, preempt=(1, 9))
    assert_all_match(outputs, references(hf_model, prompts))


def test_block_size_16_and_long_decode(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("qwen3")
    runner = make_runner(path, block_size=16, num_blocks=32)
    prompts = prompts_for(hf_model.config.vocab_size)[1:3]
    outputs = run_greedy(runner, prompts, MAX_NEW_TOKENS, num_blocks=32, chunk_size=7)
    assert_all_match(outputs, references(hf_model, prompts))


def test_garbage_in_a_fresh_cache_never_reaches_the_output(tiny_checkpoint, monkeypatch):
    path, hf_model = tiny_checkpoint("llama")
    runner = make_runner(path)
    real_zeros = torch.zeros  # the pool is zero-filled at allocation; a block is zeroed again on first use
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: real_zeros(*a, **k).fill_(float("nan")))
    runner.allocate_kv_cache(NUM_BLOCKS)  # as if the allocation had left memory full of NaN bits
    monkeypatch.undo()
    assert torch.isnan(runner.kv_caches[0][0][1:]).all()
    prompts = prompts_for(hf_model.config.vocab_size)
    outputs = run_greedy(runner, prompts, MAX_NEW_TOKENS, num_blocks=NUM_BLOCKS, arrival_steps=[0, 1, 1, 3])
    assert_all_match(outputs, references(hf_model, prompts))


def test_runner_reports_model_facts(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("llama")
    runner = make_runner(path)
    assert runner.architecture == "LlamaForCausalLM"
    assert runner.dtype == torch.float32 and runner.device == torch.device("cpu")
    assert runner.weight_bytes == sum(p.numel() * 4 for p in hf_model.parameters())
    assert runner.eos_token_ids == [2]
    layers, kv_heads, head_dim = 2, 2, 16
    assert len(runner.kv_caches) == layers
    assert runner.kv_caches[0][0].shape == (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    assert runner.kv_block_bytes() == 2 * layers * BLOCK_SIZE * kv_heads * head_dim * 4


def test_tied_weights_are_counted_once(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("qwen3")
    runner = make_runner(path)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    unique = {p.data_ptr(): p for p in hf_model.parameters()}.values()
    assert runner.weight_bytes == sum(p.numel() * 4 for p in unique)


def test_eos_ids_prefer_generation_config_list(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("llama")
    for item in path.iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert make_runner(tmp_path).eos_token_ids == [2, 7]
    (tmp_path / "generation_config.json").unlink()
    assert make_runner(tmp_path).eos_token_ids == [2]  # falls back to config.json


def test_cpu_block_budget_comes_from_bytes(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    config = EngineConfig(
        model=ModelConfig(path=str(path)),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=10 << 20),
        parallel=ParallelConfig(device="cpu"),
    )
    runner = Worker(config)
    runner.load_model()
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, float32
    assert runner.num_kv_blocks_for_budget() == (10 << 20) // bytes_per_block


def test_prompt_chunks_sample_only_at_the_end(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    runner = make_runner(path)
    prompt = list(range(3, 23))
    params = SamplingParams(temperature=0.0)
    first = runner.execute(StepPlan(0, [NewRequestData("a", prompt, 20, params, [5, 9, 1], 0, 12)], [], []))
    assert first.request_ids == [] and first.sampled_token_ids == []
    second = runner.execute(StepPlan(1, [], [RunningRequestData("a", [], [30, 7], 12, 8)], []))
    assert second.request_ids == ["a"] and len(second.sampled_token_ids) == 1
    assert second.model_time_s > 0
    forgotten = runner.execute(StepPlan(2, [], [], ["a"]))
    assert forgotten.request_ids == [] and "a" not in runner.requests.requests


def test_plan_beyond_known_blocks_is_rejected(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    runner = make_runner(path)
    params = SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="blocks"):  # 20 tokens need 5 blocks of 4; only 3 were given
        runner.execute(StepPlan(0, [NewRequestData("a", list(range(3, 23)), 20, params, [5, 9, 1], 0, 20)], [], []))
