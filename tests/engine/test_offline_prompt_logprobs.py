"""The offline API's `SamplingParams(prompt_logprobs=k)`: `GenerationResult.prompt_logprobs` as vLLM's offline
RequestOutput has it, equal to transformers' float32 log_softmax, through the real engine processes with the prompt
chunked and its prefix already cached."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_offline_prompt_logprobs_equal_transformers(tiny_checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_checkpoints("qwen2"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."
    with LLM(
        path,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=16 << 20,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
    ) as llm:
        (plain,) = llm.generate(text, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        (scored,) = llm.generate(
            text, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2, n=2), use_tqdm=False
        )
    assert plain.prompt_logprobs is None and plain.num_cached_tokens == 0
    ids = scored.prompt_token_ids
    assert ids == plain.prompt_token_ids and len(ids) > 8 and len(scored.outputs) == 2
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    logprobs = scored.prompt_logprobs
    assert len(logprobs) == len(ids) and logprobs[0] is None
    for position, entry in enumerate(logprobs[1:], start=1):
        token = ids[position]
        row = reference[position - 1]
        assert abs(entry[token].logprob - float(row[token])) < 1e-4
        assert entry[token].decoded_token == tokenizer.decode([token])
        top = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank <= 2)  # the top 2 entries
        assert [rank for rank, _ in top] == [1, 2]
        assert [logprob for _, logprob in top] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
        assert len(entry) in (2, 3)  # the token, and its top 2 (the token once when it is one of them)
