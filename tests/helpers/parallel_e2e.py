"""Tensor-parallel end-to-end runs: greedy outputs offline, and TP=2 against TP=1 and transformers."""

from __future__ import annotations

from tests.helpers.reference import assert_greedy_match

# dequantized at load, as transformers runs the GGUF
ENGINE_ARGS = dict(dtype="float32", quantization="none", max_model_len=1024, kv_cache_memory_bytes=256 << 20)
NEW_TOKENS = 16


def offline_greedy(model: str, prompts: list[list[int]], tensor_parallel_size: int) -> list[list[int]]:
    from tokenmill import LLM, SamplingParams

    with LLM(model, tensor_parallel_size=tensor_parallel_size, **ENGINE_ARGS) as llm:
        assert len(llm.processes.children) == 1 + tensor_parallel_size  # the scheduler and one worker per rank
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        return [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


def assert_tp2_matches(tp2: list[list[int]], tp1: list[list[int]], expected) -> None:
    """tp=2 equals tp=1 token for token, and both equal the reference up to its first near tie (if any)."""
    compared = [assert_greedy_match(ours, reference) for ours, reference in zip(tp2, expected, strict=True)]
    for ours, reference in zip(tp1, expected):
        assert_greedy_match(ours, reference)
    assert tp2 == tp1
    assert all(len(ours) == NEW_TOKENS for ours in tp2)
    assert sum(compared) >= len(tp2) * NEW_TOKENS // 2, f"too few tokens compared before near ties: {compared}"
