"""Acceptance: greedy outputs through the real processes are token-identical to Hugging Face transformers (float32).

The server test sends 8 prompts of different lengths concurrently; the scheduler tests run the offline `LLM` (the same
scheduler and worker processes) under chunked prefill, prefix caching, a KV pool small enough to force preemption,
and each scheduling policy.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir
from tests.helpers.reference import TEXTS, assert_greedy_match, complete_ids, hf_greedy_reference, load_reference_model
from tests.helpers.server import Server

if TYPE_CHECKING:
    from tokenmill import LLM

pytestmark = pytest.mark.slow

NEW_TOKENS = 32


def references(model, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    return [hf_greedy_reference(model, ids, NEW_TOKENS) for ids in prompts]


@pytest.fixture(scope="module")
def smollm2_hf(tiny_checkpoints):
    """The transformers SmolLM2 model, loaded once per module (loading the GGUF takes seconds)."""
    return load_reference_model("smollm2", tiny_checkpoints)


@pytest.fixture(scope="module")
def smollm2_case(smollm2_tokenizer, smollm2_hf):
    prompts = [smollm2_tokenizer.encode(t) for t in TEXTS]
    return prompts, references(smollm2_hf, prompts)


@pytest.mark.parametrize("family", ["smollm2", "llama", "qwen2", "qwen3"])
def test_server_concurrent_greedy_matches_transformers(family, tiny_checkpoints, smollm2_tokenizer, tmp_path, request):
    prompts = [smollm2_tokenizer.encode(t) for t in TEXTS]
    model_arg = str(smollm2_dir() / SMOLLM2_GGUF) if family == "smollm2" else str(tiny_checkpoints(family))
    with Server(
        model_arg,
        "--served-model-name",
        "m",
        "--dtype",
        "float32",
        "--quantization",
        "none",
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        "256MiB",
        log_path=tmp_path / "server.log",
    ) as server:
        with ThreadPoolExecutor(len(prompts)) as pool:
            ours = list(pool.map(lambda p: complete_ids(server.url, p, max_tokens=NEW_TOKENS), prompts))
    if family == "smollm2":
        expected = request.getfixturevalue("smollm2_case")[1]  # computed once for this module
    else:
        expected = references(load_reference_model(family, tiny_checkpoints), prompts)
    compared = [assert_greedy_match(o, r) for o, r in zip(ours, expected)]
    assert all(len(o) == NEW_TOKENS for o in ours)
    assert sum(compared) >= len(prompts) * NEW_TOKENS // 2, f"too few tokens compared: {compared}"


def run_offline(prompts, **engine_args) -> tuple[list[list[int]], LLM]:
    from tokenmill import LLM, SamplingParams

    # dequantized at load, as transformers runs the GGUF (tests/engine/test_quantized_gguf.py: the quantized path)
    llm = LLM(
        str(smollm2_dir() / SMOLLM2_GGUF), dtype="float32", quantization="none", max_model_len=1024, **engine_args
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    results = llm.generate(prompts, params, use_tqdm=False)
    return [r.outputs[0].token_ids for r in results], llm


SCHEDULER_CASES = {
    "chunked-prefill-small-budget": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "tiny-kv-pool-preempts": dict(num_kv_blocks=12, block_size=16, enable_prefix_caching=False),
    "priority-policy": dict(scheduling_policy="priority"),
    "sjf-policy": dict(scheduling_policy="sjf"),
}


@pytest.mark.parametrize("case", list(SCHEDULER_CASES))
def test_scheduler_configurations_match_transformers(case, smollm2_case):
    prompts, expected = smollm2_case
    ours, llm = run_offline(prompts, **SCHEDULER_CASES[case])
    llm.shutdown()
    for o, r in zip(ours, expected):
        assert_greedy_match(o, r)
        assert len(o) == NEW_TOKENS


def test_prefix_caching_hits_and_matches_transformers(smollm2_tokenizer, smollm2_hf):
    shared = (
        "You are a careful assistant. Answer briefly and precisely, cite no sources, and never apologise. "
        "The user is a student preparing for an exam in European geography and history. "
    ) * 3
    prompts = [
        smollm2_tokenizer.encode(shared + q)
        for q in ("What is the capital of Spain?", "Name a river in Germany.", "When did the Berlin wall fall?")
    ]
    expected = references(smollm2_hf, prompts)
    from tokenmill import LLM, SamplingParams

    with LLM(str(smollm2_dir() / SMOLLM2_GGUF), dtype="float32", quantization="none", max_model_len=1024) as llm:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
    results = first + rest
    for result, r in zip(results, expected):
        assert_greedy_match(result.outputs[0].token_ids, r)
    assert first[0].num_cached_tokens == 0
    shared_blocks = len(smollm2_tokenizer.encode(shared)) // 16
    for result in rest:
        assert result.num_cached_tokens >= (shared_blocks - 1) * 16
