"""A KV cache too small for one request of max_model_len: refused at start-up with the largest max_model_len that fits
(vLLM's check), unless the block count was given explicitly; then requests are admitted on their prompts and end
with "length" when they fill the whole cache."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.launcher import kv_capacity_error
from tokenmill.messages import EngineReady

# the tiny llama checkpoint: 2 layers x 2 kv heads x head dim 16, fp32 -> 512 bytes of KV per token, context 1024
TINY_KV_BYTES_PER_TOKEN = 512
FITS_512_TOKENS = 512 * TINY_KV_BYTES_PER_TOKEN  # 32 blocks of 16


def ready(num_kv_blocks: int, block_size: int = 16) -> EngineReady:
    return EngineReady(
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_model_len=0,
        weight_bytes=0,
        device="cpu",
        dtype="float32",
        architecture="LlamaForCausalLM",
    )


def config(max_model_len: int, num_kv_blocks: int = 0, task: str = "generate") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(max_model_len=max_model_len, task=task), cache=CacheConfig(num_kv_blocks=num_kv_blocks)
    )


def test_a_budget_that_cannot_hold_one_full_length_request_is_refused_with_the_largest_that_fits():
    error = kv_capacity_error(config(1024), ready(32))
    assert error is not None and error.endswith("the largest max_model_len that fits is 512.")
    assert error.count(". ") == 0  # one sentence


@pytest.mark.parametrize(
    "cfg, blocks",
    [
        (config(512), 32),  # exactly fits
        (config(1024, num_kv_blocks=32), 32),  # an explicit block count is taken as asked (a warning only)
        (config(1024, task="embed"), 0),  # embeddings keep no KV cache
    ],
)
def test_no_refusal(cfg, blocks):
    assert kv_capacity_error(cfg, ready(blocks)) is None


@pytest.fixture
def tiny_llama(tiny_checkpoints) -> str:
    return str(tiny_checkpoints("llama"))


@pytest.mark.slow
def test_llm_refuses_to_start_and_leaves_no_processes(tiny_llama):
    from tokenmill import LLM

    with pytest.raises(ValueError, match="the largest max_model_len that fits is 512"):
        LLM(tiny_llama, kv_cache_memory_bytes=FITS_512_TOKENS)
    assert psutil.Process().children(recursive=True) == []


@pytest.mark.slow
def test_serve_refuses_to_start_with_that_sentence(tiny_llama):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            tiny_llama,
            "--port",
            "0",
            "--kv-cache-memory-bytes",
            str(FITS_512_TOKENS),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1
    assert "the largest max_model_len that fits is 512." in done.stderr + done.stdout


@pytest.mark.slow
def test_without_max_tokens_a_request_runs_in_a_cache_smaller_than_max_model_len(tiny_llama):
    from tokenmill import LLM, SamplingParams

    with LLM(tiny_llama, num_kv_blocks=4, block_size=16) as llm:  # 64 tokens, max_model_len 1024
        (result,) = llm.generate(
            "Hello", SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), use_tqdm=False
        )
    output = result.outputs[0]
    assert output.finish_reason == "length"
    assert len(result.prompt_token_ids) + len(output.token_ids) == 64
