"""`kv_cache_dtype="fp8"` on the default model (SmolLM2-135M, float32 activations) in the worker's Worker, and
through the offline `LLM` on a tiny checkpoint: the cache holds one byte per element, so a byte budget holds 4x the
float32 blocks, and greedy output stays close to the float32 cache's (fp8 keys are lossy: close, not identical).
Checkpoint KV-cache scales land on the attention layers.

`kv_cache_dtype="float16" | "bfloat16"` under a float32 model: two bytes a cached element instead of four (half the
bytes decode attention reads; llama.cpp caches float16 by default), no scales, the model's own dtype for everything
else. A 16-bit cache under other 16-bit activations is refused with one sentence.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from tests.helpers.runner_driver import logits_in_chunks, run_greedy
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.frontend.tokenizer import load_tokenizer
from tokenmill.kernels.kv_quant import kv_cache_torch_dtype
from tokenmill.model_source import resolve_config
from tokenmill.workers.model_loader import iter_weights
from tokenmill.workers.models.registry import model_class
from tokenmill.workers.worker import Worker

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite programming language is",
    "In 1969, the first person to walk on the Moon",
    "To make a cup of tea, first",
]
MAX_NEW_TOKENS = 16
NUM_BLOCKS = 64
BUDGET = 64 << 20
# Measured (first divergence per prompt, fp8 e4m3 with scale 1.0 vs the float32 cache): [5, 13, 5, 3, 9, 16, 16, 6]
# here, [5, 13, 5, 3, 16, 12, 7, 13] through the offline LLM (whole prompts). SmolLM2-135M is sensitive: 3 mantissa
# bits put ~2% noise on every key, teacher-forced next-token KL is 0.012 nats and 5% of argmaxes flip
# (docs/benchmarks.md). The floors leave room below that and still catch a grossly broken path (on the tiny
# checkpoint, scales applied on write but not on read give KL 2.5 instead of 0.008).
MIN_AGREEING_PREFIX, MIN_MEAN_AGREEING_PREFIX = 2, 5


def use_kv_cache_dtype(runner: Worker, name: str) -> None:
    """The same weights over a KV cache of another dtype: the next `allocate_kv_cache` follows the config."""
    cache = msgspec.structs.replace(
        runner.config.cache, kv_cache_dtype=name, num_kv_blocks=0, kv_cache_memory_bytes=BUDGET
    )
    runner.config = msgspec.structs.replace(runner.config, cache=cache)


@pytest.fixture(scope="module")
def default_model():
    """(runner with the default model loaded, tokenized prompts)."""
    config = resolve_config(
        EngineConfig(
            model=ModelConfig(model="", dtype="float32"),
            cache=CacheConfig(num_kv_blocks=NUM_BLOCKS),
            parallel=ParallelConfig(device="cpu"),
        )
    )
    runner = Worker(config)
    runner.load_model()
    tokenizer = load_tokenizer(config.model)
    return runner, [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def greedy(runner: Worker, prompts: list[list[int]], kv_cache_dtype: str) -> list[list[int]]:
    use_kv_cache_dtype(runner, kv_cache_dtype)
    runner.allocate_kv_cache(NUM_BLOCKS)
    return run_greedy(runner, prompts, MAX_NEW_TOKENS, num_blocks=NUM_BLOCKS, chunk_size=5)


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.slow
def test_fp8_kv_cache_holds_four_times_the_float32_blocks(default_model):
    runner, _ = default_model
    use_kv_cache_dtype(runner, "auto")
    float32_blocks, float32_block_bytes = runner.num_kv_blocks_for_budget(), runner.kv_block_bytes()
    use_kv_cache_dtype(runner, "fp8")
    assert runner.kv_cache_dtype == torch.float8_e4m3fn
    assert runner.kv_block_bytes() * 4 == float32_block_bytes
    # 64 MiB: 91 float32 blocks (30 layers x K and V x 16 tokens x 3 heads x 64 dims x 4 bytes = 720 KiB each)
    assert (float32_blocks, runner.num_kv_blocks_for_budget()) == (91, 364)
    runner.allocate_kv_cache(8)
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert (runner.kv_caches[0][0][0].view(torch.uint8) == 0).all()  # block 0 zeroed at once, as bytes


@pytest.mark.slow
def test_fp8_greedy_output_stays_close_to_the_float32_cache(default_model):
    """The first 16 greedy tokens of 8 prompts: fp8 keys are lossy, so close to the float32 cache's, not identical.
    (The torch path's fp8 reads and writes are held to the kernels' in test_worker_attention.py and
    tests/kernels/test_cpu_ops.py.)"""
    runner, prompts = default_model
    reference = greedy(runner, prompts, "auto")
    fp8 = greedy(runner, prompts, "fp8")
    agreeing = [agreeing_prefix(a, b) for a, b in zip(reference, fp8)]
    print("tokens agreeing with the float32 cache, per prompt:", agreeing)
    assert min(agreeing) >= MIN_AGREEING_PREFIX, agreeing
    assert sum(agreeing) >= MIN_MEAN_AGREEING_PREFIX * len(agreeing), agreeing


def test_checkpoint_kv_scales_set_the_attention_scales(tiny_checkpoint):
    """vLLM's spellings: self_attn.k_scale / v_scale, kv_scale (both), k_proj/v_proj.output_scale; q and prob scales
    are read and dropped; a layer without any keeps 1.0."""
    path, hf_model = tiny_checkpoint("llama")
    model = model_class("LlamaForCausalLM")(hf_model.config)
    scales = [
        ("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
        ("model.layers.0.self_attn.v_proj.output_scale", torch.tensor([0.25])),
        ("model.layers.0.self_attn.q_scale", torch.tensor(3.0)),
        ("model.layers.1.self_attn.kv_scale", torch.tensor([2.0, 1.5])),
    ]  # per head: the largest
    model.load_weights([*iter_weights(ModelConfig(path=str(path))), *scales])
    layers = [layer.self_attn.attn_layer for layer in model.model.layers]
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.5, 0.25), (2.0, 2.0)]
    untouched = model_class("LlamaForCausalLM")(hf_model.config)
    untouched.load_weights(iter_weights(ModelConfig(path=str(path))))
    assert all(
        (layer.self_attn.attn_layer.k_scale, layer.self_attn.attn_layer.v_scale) == (1.0, 1.0)
        for layer in untouched.model.layers
    )
    with pytest.raises(ValueError, match="positive"):
        model.load_weights([("model.layers.0.self_attn.k_scale", torch.tensor(0.0))])


def test_scales_apply_only_to_an_fp8_cache(tiny_checkpoint):
    """With a float32 cache the layer scales change nothing; with an fp8 one the model reads what it stored (its
    logits stay near the float32 cache's whatever the scale)."""
    path, hf_model = tiny_checkpoint("llama")
    model = model_class("LlamaForCausalLM")(hf_model.config)
    model.load_weights(iter_weights(ModelConfig(path=str(path))))
    input_ids = torch.randint(3, hf_model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    chunks = [0, 11, 12, 30]
    plain = logits_in_chunks(model, input_ids, chunks)
    for layer in model.model.layers:
        layer.self_attn.attn_layer.k_scale, layer.self_attn.attn_layer.v_scale = 0.37, 3.1
    assert torch.equal(logits_in_chunks(model, input_ids, chunks), plain)
    fp8 = logits_in_chunks(model, input_ids, chunks, kv_cache_dtype=torch.float8_e4m3fn)
    assert not torch.equal(fp8, plain)
    # about 0.008 at any scale; 2.5 when the scales are applied on write but not on read
    assert mean_kl(plain, fp8) < 0.05


def mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    reference, other = reference_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    return float((reference.exp() * (reference - other)).sum(-1).mean())


@pytest.mark.slow
def test_llm_runs_with_an_fp8_kv_cache_of_four_times_the_blocks(tiny_checkpoints):
    from tokenmill import LLM, SamplingParams

    # the tiny llama: 2 layers x 2 kv heads x head dim 16 -> 512 bytes of float32 KV a token, 128 in fp8
    with LLM(
        str(tiny_checkpoints("llama")), kv_cache_dtype="fp8", kv_cache_memory_bytes=32 * 16 * 512, max_model_len=256
    ) as llm:
        assert llm.engine_info.num_kv_blocks == 4 * 32
        out = llm.generate(
            ["Hello there", "A longer prompt of a few more words"],
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
    assert [len(r.outputs[0].token_ids) for r in out] == [12, 12]
    with pytest.raises(ValueError, match="must be one of auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2"):
        LLM(str(tiny_checkpoints("llama")), kv_cache_dtype="int8")


# ---------------------------------------------------------------- 16-bit caches under a float32 model

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.mark.slow
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_a_16_bit_cache_holds_twice_the_float32_blocks(default_model, name):
    runner, _ = default_model
    use_kv_cache_dtype(runner, "auto")
    float32_blocks, float32_block_bytes = runner.num_kv_blocks_for_budget(), runner.kv_block_bytes()
    use_kv_cache_dtype(runner, name)
    assert runner.kv_cache_dtype == HALF_DTYPES[name]
    assert runner.kv_block_bytes() * 2 == float32_block_bytes
    assert (float32_blocks, runner.num_kv_blocks_for_budget()) == (91, 182)  # 64 MiB of 720 / 360 KiB blocks


@pytest.mark.slow
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_greedy_output_over_a_16_bit_cache_stays_with_the_float32_caches(default_model, name):
    """The first 16 greedy tokens of 8 prompts on the default model. Its GGUF matmuls quantize each activation row
    to int8, which makes any perturbation of the keys, even a relative 1e-7, move the next-token distributions by a
    KL of ~3e-3 (measured: docs/benchmarks.md), so the 16-bit caches (K/V rounded to 10 or 7 mantissa bits) diverge
    at the near-ties like that, not more: measured first divergences [16, 13, 16, 8, 10, 12, 12, 5] (float16) and
    [16, 13, 16, 16, 16, 12, 12, 5] (bfloat16); fp8's were [16, 15, 5, 3, 9, 16, 12, 12]. The
    floors leave room below those."""
    runner, prompts = default_model
    reference = greedy(runner, prompts, "auto")
    half = greedy(runner, prompts, name)
    agreeing = [agreeing_prefix(a, b) for a, b in zip(reference, half)]
    print(f"tokens agreeing with the float32 cache ({name}), per prompt:", agreeing)
    assert min(agreeing) >= 3, agreeing
    assert sum(agreeing) >= 8 * len(agreeing), agreeing


# measured: 4.3e-7 (float16), 2.5e-5 (bfloat16): the rounding of 10 and 7 mantissa bits, squared
@pytest.mark.parametrize("cache_dtype, max_kl", [(torch.float16, 1e-5), (torch.bfloat16, 2e-4)])
def test_a_16_bit_cache_reads_what_it_stored(tiny_checkpoint, cache_dtype, max_kl):
    """Chunked prefill then decode over a shuffled paged cache (the cache written by one step and read by later
    ones) on float32 weights: next-token distributions within rounding of the float32 cache's, and the layer
    scales ignored."""
    path, hf_model = tiny_checkpoint("llama")
    model = model_class("LlamaForCausalLM")(hf_model.config)
    model.load_weights(iter_weights(ModelConfig(path=str(path))))
    input_ids = torch.randint(3, hf_model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    chunks = [0, 11, 12, 13, 30]
    plain = logits_in_chunks(model, input_ids, chunks)
    half = logits_in_chunks(model, input_ids, chunks, kv_cache_dtype=cache_dtype)
    assert not torch.equal(half, plain)
    assert mean_kl(plain, half) < max_kl
    for layer in model.model.layers:
        layer.self_attn.attn_layer.k_scale, layer.self_attn.attn_layer.v_scale = 0.37, 3.1
    assert torch.equal(logits_in_chunks(model, input_ids, chunks, kv_cache_dtype=cache_dtype), half)


def test_a_16_bit_cache_narrows_only_a_float32_model():
    assert kv_cache_torch_dtype("float16", torch.float32) == torch.float16
    assert kv_cache_torch_dtype("bfloat16", torch.bfloat16) == torch.bfloat16  # the model's own: as "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype float16 narrows only a float32 model's cache"):
        kv_cache_torch_dtype("float16", torch.bfloat16)


@pytest.mark.slow
def test_llm_runs_with_a_float16_kv_cache_of_twice_the_blocks(tiny_checkpoints):
    from tokenmill import LLM, SamplingParams

    prompts = ["Hello there", "A longer prompt of a few more words"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for name in ("auto", "float16"):
        # the tiny llama: 2 layers x 2 kv heads x head dim 16 -> 512 bytes of float32 KV a token, 256 in float16
        with LLM(
            str(tiny_checkpoints("llama")),
            dtype="float32",
            kv_cache_dtype=name,
            kv_cache_memory_bytes=32 * 16 * 512,
            max_model_len=256,
        ) as llm:
            assert llm.engine_info.num_kv_blocks == (32 if name == "auto" else 64)
            outputs[name] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    assert [len(ids) for ids in outputs["float16"]] == [12, 12]
    assert outputs["float16"] == outputs["auto"]
