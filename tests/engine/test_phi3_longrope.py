"""Acceptance for Phi-3 (fused qkv / gate_up checkpoint tensors, partial rotary 0.75, LongRoPE): greedy tokens through
the real processes equal transformers' `generate` in float32, with chunked prefill and prefix caching on, and on two
tensor-parallel ranks on CPU.

The tiny checkpoint's original context is 64 tokens of 1024 (tests/helpers/checkpoints.py "phi3"). With max_model_len
1024 the engine rotates every position with the long factors (workers/models/rope.py), which is what transformers does
for a prompt longer than the original context, so every prompt here is longer than 64 tokens.
"""

from __future__ import annotations

import pytest

from tests.helpers.parallel_e2e import assert_tp2_matches, offline_greedy
from tests.helpers.reference import assert_greedy_match, hf_greedy_reference, load_reference_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
SHARED = (
    "You are a careful assistant. Answer briefly and precisely, cite no sources, and never apologise. The user "
    "is a student preparing for an exam in European geography and history, and asks one question at a time. "
    "Keep every answer under fifty words, name dates and places exactly, and say so when you do not know. "
)
QUESTIONS = [
    "What is the capital of Spain?",
    "Name a river in Germany and the sea it flows into.",
    "When did the Berlin wall fall, and why?",
]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    ids = [smollm2_tokenizer.encode(SHARED + q) for q in QUESTIONS]
    assert all(len(p) > 64 for p in ids), "each prompt must pass the original context of 64 tokens"
    return ids


@pytest.fixture(scope="module")
def expected(prompts, tiny_checkpoints):
    model = load_reference_model("phi3", tiny_checkpoints)
    return [hf_greedy_reference(model, p, NEW_TOKENS) for p in prompts]


def test_phi3_greedy_with_chunked_prefill_and_prefix_caching_matches_transformers(prompts, expected, tiny_checkpoints):
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(
        str(tiny_checkpoints("phi3")),
        dtype="float32",
        max_model_len=1024,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=24,
        block_size=16,
    ) as llm:
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # 24-token chunks, across position 64
        rest = llm.generate(prompts[1:], params, use_tqdm=False)  # these read the shared prefix from the cache
    results = first + rest
    compared = [assert_greedy_match(r.outputs[0].token_ids, ref) for r, ref in zip(results, expected)]
    assert all(len(r.outputs[0].token_ids) == NEW_TOKENS for r in results)
    assert sum(compared) >= len(prompts) * NEW_TOKENS // 2, f"too few tokens compared before near ties: {compared}"
    assert first[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens >= 32 for r in rest), [r.num_cached_tokens for r in rest]


def test_phi3_on_two_ranks_matches_one_rank_and_transformers(prompts, expected, tiny_checkpoints):
    model = str(tiny_checkpoints("phi3"))
    tp2 = offline_greedy(model, prompts, tensor_parallel_size=2)
    tp1 = offline_greedy(model, prompts, tensor_parallel_size=1)
    assert_tp2_matches(tp2, tp1, [ref[: len(tp2[0])] for ref in expected])
