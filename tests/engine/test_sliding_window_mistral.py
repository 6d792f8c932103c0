"""Acceptance: a Mistral model (every layer a 24-key sliding window) through the real processes, float32, with chunked
prefill and prefix caching: greedy tokens identical to transformers' `generate` for prompts longer than the window,
and the KV blocks a request holds stay bounded while it generates far past the window (read from the scheduler's
step summaries: the pool's free blocks)."""

from __future__ import annotations

import pytest

from tests.helpers.reference import assert_greedy_match, hf_greedy_reference

pytestmark = pytest.mark.slow

WINDOW, BLOCK_SIZE = 24, 8
BOUND = -(-WINDOW // BLOCK_SIZE) + 1  # blocks a decoding request holds: ceil(window / block_size) + 1
NEW_TOKENS = 80
LONG_TOKENS = 400  # the bounded-blocks run: long enough that sampled summaries see it even on a loaded machine
TEXTS = [
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his "
    "daughter. Every morning the woodcutter walked into the forest with his axe, and every evening he came back",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his "
    "daughter. Every morning the daughter",
]


def test_mistral_sliding_window_matches_transformers_with_bounded_blocks(tiny_checkpoints, smollm2_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM, SamplingParams

    path = tiny_checkpoints("mistral")
    prompts = [smollm2_tokenizer.encode(t) for t in TEXTS]
    assert all(len(p) > WINDOW for p in prompts)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.sliding_window == WINDOW
    model.generation_config.eos_token_id = None
    expected = [hf_greedy_reference(model, p, NEW_TOKENS) for p in prompts]

    summaries = []
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(
        str(path),
        dtype="float32",
        max_model_len=512,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    ) as llm:
        # one at a time, so the pool's use is this request's; the second shares the first's prompt prefix
        results = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        llm.watch_steps(summaries.append, interval_s=0.001)
        long = llm.generate(
            [prompts[0]], SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False
        )[0]
        llm.watch_steps(None)
    compared = [assert_greedy_match(r.outputs[0].token_ids, e) for r, e in zip(results, expected)]
    assert all(len(r.outputs[0].token_ids) == NEW_TOKENS for r in results)
    assert sum(compared) >= NEW_TOKENS, f"too few tokens compared: {compared}"
    assert results[1].num_cached_tokens > 0, "the shared prefix should have been a prefix-cache hit"

    assert len(long.outputs[0].token_ids) == LONG_TOKENS
    decoding = [s for s in summaries if len(s.queue) == 1 and s.queue[0].running and s.queue[0].output_tokens >= 2]
    assert len(decoding) >= 3, f"too few summaries while decoding: {len(summaries)} in all"
    held = [s.num_blocks - s.num_free_blocks for s in decoding]
    longest = max(s.queue[0].prompt_tokens + s.queue[0].output_tokens for s in decoding)
    assert longest > 4 * WINDOW  # generated far past the window...
    assert max(held) <= BOUND, f"blocks held while decoding: {held}"  # ...on a bounded number of blocks
