"""Acceptance for mixture-of-experts models: tiny random-weight Mixtral and Qwen3-MoE checkpoints served through the
offline `LLM` (real scheduler and worker processes, float32, chunked prefill with a small token budget, prefix
caching on) generate what transformers' greedy `generate` does; Qwen3-MoE also on two tensor-parallel ranks (gloo on
CPU), with every expert's intermediate dimension split across them."""

from __future__ import annotations

import pytest

from tests.helpers.reference import TEXTS, assert_greedy_match, hf_greedy_reference, load_reference_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
SHARED = (
    "You are a careful assistant. Answer briefly and precisely, cite no sources, and never apologise. "
    "The user is a student preparing for an exam in European geography and history. "
) * 2
QUESTIONS = ["What is the capital of Spain?", "Name a river in Germany."]
ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=1024,
    kv_cache_memory_bytes=256 << 20,
    enable_prefix_caching=True,
    max_num_batched_tokens=32,
)


def generate(model: str, prompts: list[list[int]], tensor_parallel_size: int = 1):
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model, tensor_parallel_size=tensor_parallel_size, **ENGINE_ARGS) as llm:
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # fills the prefix cache for the shared prompts
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
    return first + rest


def check(family, tiny_checkpoints, smollm2_tokenizer, tensor_parallel_size=1):
    prompts = [smollm2_tokenizer.encode(SHARED + q) for q in QUESTIONS]
    prompts += [smollm2_tokenizer.encode(t) for t in TEXTS[:5]]
    results = generate(str(tiny_checkpoints(family)), prompts, tensor_parallel_size)
    ours = [r.outputs[0].token_ids for r in results]
    model = load_reference_model(family, tiny_checkpoints)
    expected = [hf_greedy_reference(model, p, NEW_TOKENS) for p in prompts]
    compared = [assert_greedy_match(o, r) for o, r in zip(ours, expected, strict=True)]
    assert all(len(o) == NEW_TOKENS for o in ours)
    assert sum(compared) >= len(prompts) * NEW_TOKENS // 2, f"too few tokens compared before near ties: {compared}"
    shared_blocks = len(smollm2_tokenizer.encode(SHARED)) // 16
    assert results[1].num_cached_tokens >= (shared_blocks - 1) * 16, "the second shared prompt hit no cached prefix"
    return ours


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_greedy_matches_transformers(family, tiny_checkpoints, smollm2_tokenizer):
    check(family, tiny_checkpoints, smollm2_tokenizer)


def test_qwen3_moe_on_two_ranks_matches_transformers(tiny_checkpoints, smollm2_tokenizer):
    check("qwen3_moe", tiny_checkpoints, smollm2_tokenizer, tensor_parallel_size=2)
