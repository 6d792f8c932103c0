"""Offline multi-LoRA: `LLM(..., enable_lora=True)` and `generate(..., lora_request=...)` on SmolLM2-135M's real
shapes (random weights, 4 layers): one batch mixing three PEFT adapters (ranks 8 and 64; {q, v} and every
projection) and the base model gives, in float32, each prompt the greedy tokens of transformers + PEFT with its
adapter; a lora_request without enable_lora is refused."""

from __future__ import annotations

import copy

import pytest

from tests.helpers.lora_adapters import (
    ALL_PROJECTIONS,
    QV,
    build_smollm2_shaped_checkpoint,
    make_peft_model,
    save_peft_adapter,
)
from tests.helpers.reference import assert_greedy_match, hf_greedy_reference
from tokenmill import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three fruits:",
    "Q: What is 12 times 12?\nA:",
    "Once upon a time",
    "def fibonacci(n):",
]
# prompt i runs with ADAPTER_OF[i] (None: the base model)
ADAPTERS = {"qv-r8": (8, QV), "all-r64": (64, ALL_PROJECTIONS), "all-r8": (8, ALL_PROJECTIONS)}
ADAPTER_OF = ["qv-r8", None, "all-r64", "all-r8", "qv-r8", None]


def _reference(model, prompt_ids: list[int]) -> list[tuple[int, float]]:
    model = copy.deepcopy(model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    return hf_greedy_reference(model, prompt_ids, NEW_TOKENS)


@pytest.fixture(scope="module")
def smollm2_loras(tmp_path_factory):
    """(checkpoint path, base model, name -> (LoRARequest, PEFT model))."""
    root = tmp_path_factory.mktemp("smollm2-lora")
    path, base = build_smollm2_shaped_checkpoint(root)
    made = {}
    for lora_id, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        peft_model = make_peft_model(base, rank, targets, seed=10 + lora_id)
        save_peft_adapter(peft_model, root / name)
        made[name] = (LoRARequest(name, lora_id, str(root / name)), peft_model)
    return path, base, made


@pytest.mark.slow
def test_one_batch_of_three_adapters_and_the_base_matches_transformers_peft(smollm2_loras):
    path, base, adapters = smollm2_loras
    loras = [adapters[name][0] if name else None for name in ADAPTER_OF]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(
        str(path), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=64, max_model_len=256, seed=0
    ) as llm:
        tokenizer = llm.get_tokenizer()
        prompt_ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
        results = llm.generate(prompt_ids, params, use_tqdm=False, lora_request=loras)
        base_results = llm.generate(prompt_ids, params, use_tqdm=False)
    for name, ids, result, base_result in zip(ADAPTER_OF, prompt_ids, results, base_results, strict=True):
        ours = result.outputs[0].token_ids
        reference = _reference(adapters[name][1] if name else base, ids)
        assert assert_greedy_match(ours, reference) >= NEW_TOKENS // 2, f"{name}: a near tie too early to tell"
        assert (ours == base_result.outputs[0].token_ids) == (name is None), f"{name}: the adapter changes tokens"


def test_a_lora_request_without_enable_lora_is_refused_in_one_sentence(tiny_checkpoints, tmp_path):
    adapter = LoRARequest("some-adapter", 1, str(tmp_path))
    with LLM(str(tiny_checkpoints("llama")), max_model_len=128, kv_cache_memory_bytes=8 << 20) as llm:
        with pytest.raises(ValueError, match=r"^a lora_request was given but LoRA is disabled: .*enable_lora=True$"):
            llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False, lora_request=adapter)
        with pytest.raises(ValueError, match="one lora_request, or one per prompt"):
            llm.generate(["Hi", "Ho"], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=[None])
