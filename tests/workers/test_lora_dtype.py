"""`--lora-dtype` on the worker: the slots hold the adapters in bfloat16 under a float32 model, and a step mixing two
adapters and the base model gives each request the greedy tokens of transformers + PEFT run in float32 on the same
adapter with its A and B rounded to bfloat16 (the slots' only difference from float32 slots), on the native kernel
and on the torch path. The adapters' scales (alpha / r) are powers of two, so rounding B before or after the scale
is folded in gives the same weights."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.lora_adapters import ALL_PROJECTIONS, QV, make_peft_model, save_peft_adapter
from tests.helpers.reference import assert_greedy_match, hf_greedy_reference
from tests.helpers.runner_driver import run_greedy
from tokenmill.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig
from tokenmill.kernels import lora_cpu
from tokenmill.messages import LoRARequest
from tokenmill.workers.lora.manager import slot_dtype
from tokenmill.workers.worker import Worker

NUM_BLOCKS = 128
NEW_TOKENS = 10
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
ADAPTERS = {"qv8": (8, QV), "all64": (64, ALL_PROJECTIONS)}  # scales 2 and 1/4: exact in any dtype


def _reference_model(model):
    """A copy whose generate runs to max_new_tokens (as the driver does), LoRA weights rounded to bfloat16."""
    model = copy.deepcopy(model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.generation_config.eos_token_id = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(param.to(torch.bfloat16).float())
    return model


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """name -> (LoRARequest, reference model with bf16-rounded adapter); "base" -> (None, the base model)."""
    _, base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora-dtype")
    made = {"base": (None, _reference_model(base))}
    for lora_id, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        peft_model = make_peft_model(base, rank, targets, seed=10 + lora_id)
        save_peft_adapter(peft_model, root / name)
        made[name] = (LoRARequest(name, lora_id, str(root / name)), _reference_model(peft_model))
    return made


def _worker(path, lora_dtype: str) -> Worker:
    lora = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=64, lora_dtype=lora_dtype)
    config = EngineConfig(
        model=ModelConfig(path=str(path)),
        cache=CacheConfig(block_size=4, num_kv_blocks=NUM_BLOCKS),
        parallel=ParallelConfig(device="cpu"),
        lora=lora,
    )
    worker = Worker(config)
    worker.load_model()
    worker.allocate_kv_cache(NUM_BLOCKS)
    return worker


@pytest.mark.parametrize("cpu_backend", ["kernels", "torch"])
def test_bfloat16_slots_under_a_float32_model_match_peft_on_the_rounded_adapter(
    tiny_checkpoint, adapters, use_cpu_backend, cpu_backend
):
    use_cpu_backend(cpu_backend)
    assert lora_cpu.enabled() == (cpu_backend == "kernels")
    path, _ = tiny_checkpoint("llama")
    worker = _worker(path, "bfloat16")
    assert worker.lora is not None and worker.dtype == torch.float32
    assert {layer.a.dtype for layer in worker.lora.layers} == {torch.bfloat16}
    names = ["qv8", "base", "all64"]
    outputs = run_greedy(
        worker, PROMPTS, NEW_TOKENS, num_blocks=NUM_BLOCKS, chunk_size=3, lora_requests=[adapters[n][0] for n in names]
    )
    for name, prompt, ours in zip(names, PROMPTS, outputs, strict=True):
        reference = hf_greedy_reference(adapters[name][1], prompt, NEW_TOKENS)
        assert assert_greedy_match(ours, reference) >= NEW_TOKENS // 2, f"{name}: near tie too early to tell"


def test_auto_is_the_model_dtype_and_the_narrow_ones_are_theirs():
    assert slot_dtype(LoRAConfig(), torch.float32) is torch.float32
    assert slot_dtype(LoRAConfig(), torch.bfloat16) is torch.bfloat16
    assert slot_dtype(LoRAConfig(lora_dtype="bfloat16"), torch.float32) is torch.bfloat16
    assert slot_dtype(LoRAConfig(lora_dtype="float16"), torch.float32) is torch.float16
    with pytest.raises(ValueError, match="lora_dtype must be one of auto, float16, bfloat16, got 'float8'"):
        LoRAConfig(lora_dtype="float8")  # type: ignore[arg-type]


def test_the_offline_llm_takes_lora_dtype_into_the_one_config():
    from tokenmill.llm import _engine_config

    config = _engine_config("", {"enable_lora": True, "lora_dtype": "bfloat16"})
    assert config.lora.lora_dtype == "bfloat16"
