"""Multi-LoRA on the worker: one step mixing adapters and the base model gives each request the tokens
transformers + PEFT gives with its adapter (chunked prefill and a preemption included), adapters beyond the slots
are evicted least recently used and come back right, and bad adapters are refused with a sentence naming the fault."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.lora_adapters import ALL_PROJECTIONS, QV, make_peft_model, save_peft_adapter
from tests.helpers.reference import assert_greedy_match, hf_greedy_reference
from tests.helpers.runner_driver import run_greedy
from tests.helpers.spec_decode_runs import generate
from tokenmill.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from tokenmill.kernels import lora_cpu
from tokenmill.lora import check_adapter_tensors, read_peft_config
from tokenmill.messages import EngineRequest, LoRARequest, SamplingParams
from tokenmill.workers.lora.adapter import load_adapter
from tokenmill.workers.worker import Worker

NUM_BLOCKS = 128
NEW_TOKENS = 10
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21, 22, 23], [24, 25, 26, 27, 28, 29]]
# name -> (rank, target modules, rsLoRA)
ADAPTERS = {"qv8": (8, QV, False), "all8": (8, ALL_PROJECTIONS, True), "all64": (64, ALL_PROJECTIONS, False)}


def _no_eos(model):
    """A copy of `model` whose generate runs to max_new_tokens, as the worker driver does."""
    model = copy.deepcopy(model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """name -> (LoRARequest, PEFT reference model); "base" -> (None, the base model)."""
    path, base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora")
    made = {"base": (None, _no_eos(base))}
    for lora_id, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items(), start=1):
        peft_model = make_peft_model(base, rank, targets, seed=lora_id, use_rslora=rslora)
        save_peft_adapter(peft_model, root / name)
        made[name] = (LoRARequest(name, lora_id, str(root / name)), _no_eos(peft_model))
    return made


def _worker(
    path, max_loras: int, max_lora_rank: int = 64, max_cpu_loras: int | None = None, block_size: int = 4
) -> Worker:
    lora = LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)
    config = EngineConfig(
        model=ModelConfig(path=str(path)),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=NUM_BLOCKS),
        parallel=ParallelConfig(device="cpu"),
        lora=lora,
    )
    worker = Worker(config)
    worker.load_model()
    worker.allocate_kv_cache(NUM_BLOCKS)
    return worker


def _check_against_peft(adapters, names: list[str], outputs: list[list[int]]) -> None:
    for name, prompt, ours in zip(names, PROMPTS, outputs, strict=True):
        reference = hf_greedy_reference(adapters[name][1], prompt, NEW_TOKENS)
        assert assert_greedy_match(ours, reference) >= NEW_TOKENS // 2, f"{name}: near tie too early to tell"


@pytest.mark.parametrize("cpu_backend", ["kernels", "torch"])  # the native LoRA kernel, and the torch grouped path
def test_one_step_mixing_three_adapters_and_the_base_matches_peft(
    tiny_checkpoint, adapters, use_cpu_backend, cpu_backend
):
    use_cpu_backend(cpu_backend)
    assert lora_cpu.enabled() == (cpu_backend == "kernels")
    path, _ = tiny_checkpoint("llama")
    worker = _worker(path, max_loras=3)
    names = ["qv8", "base", "all8", "all64", "qv8"]
    loras = [adapters[name][0] for name in names]
    outputs = run_greedy(
        worker, PROMPTS, NEW_TOKENS, num_blocks=NUM_BLOCKS, chunk_size=3, preempt=(2, 4), lora_requests=loras
    )
    _check_against_peft(adapters, names, outputs)
    base_outputs = run_greedy(worker, PROMPTS, NEW_TOKENS, num_blocks=NUM_BLOCKS)
    for name, ours, base in zip(names, outputs, base_outputs, strict=True):
        assert (ours == base) == (name == "base"), f"{name}: the adapter must change the tokens"


def test_adapters_beyond_the_slots_are_evicted_lru_and_reload_correctly(tiny_checkpoint, adapters):
    path, _ = tiny_checkpoint("llama")
    worker = _worker(path, max_loras=2, max_cpu_loras=2)
    assert worker.lora is not None
    runs = [["qv8", "all8"], ["all64", "base"], ["qv8", "all64"], ["all8", "qv8"]]
    for names in runs:
        prompts = PROMPTS[: len(names)]
        outputs = run_greedy(
            worker, prompts, NEW_TOKENS, num_blocks=NUM_BLOCKS, lora_requests=[adapters[n][0] for n in names]
        )
        for name, prompt, ours in zip(names, prompts, outputs, strict=True):
            assert_greedy_match(ours, hf_greedy_reference(adapters[name][1], prompt, NEW_TOKENS))
    ids = {name: adapters[name][0].lora_int_id for name in ADAPTERS}
    # run 2 evicted qv8's or all8's slot (least recently used: a tie, the lower slot); run 3 brought qv8 back from
    # disk (the host cache of 2 had dropped it) over all8, run 4 all8 over all64
    assert sorted(worker.lora.slot_ids) == sorted([ids["qv8"], ids["all8"]])
    assert worker.lora.loads_from_disk == 5
    assert list(worker.lora.host) == [ids["qv8"], ids["all8"]]


def test_a_step_with_more_adapters_than_slots_is_refused_before_any_slot_changes(tiny_checkpoint, adapters):
    path, _ = tiny_checkpoint("llama")
    worker = _worker(path, max_loras=2)
    assert worker.lora is not None
    requests = [adapters[name][0] for name in ADAPTERS]
    with pytest.raises(ValueError, match="3 distinct LoRA adapters but max_loras=2"):
        worker.lora.assign_slots(requests)
    assert worker.lora.slot_ids == [None, None]


def test_rank_above_the_limit_is_refused_naming_rank_and_limit(adapters):
    request = adapters["all64"][0]
    with pytest.raises(ValueError, match=r"rank 64, above max_lora_rank=16"):
        read_peft_config(request.lora_path, max_lora_rank=16)
    with pytest.raises(ValueError, match=r"rank 64, above max_lora_rank=16"):
        load_adapter(request, max_lora_rank=16, num_layers=2)


def test_scale_is_alpha_over_rank_or_over_its_root_with_rslora(adapters):
    plain = read_peft_config(adapters["qv8"][0].lora_path, 64)
    rslora = read_peft_config(adapters["all8"][0].lora_path, 64)
    assert (plain.scale, rslora.scale) == (16 / 8, pytest.approx(16 / 8**0.5))
    loaded = load_adapter(adapters["all8"][0], 64, 2)
    peft_layer = adapters["all8"][1].base_model.model.model.layers[1].mlp.down_proj
    torch.testing.assert_close(loaded.pairs[(1, "down_proj")].b, peft_layer.lora_B["default"].weight * rslora.scale)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target module 'embed_tokens' is not supported"),
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 0}, "'r' must be a positive integer"),
    ],
)
def test_unsupported_adapter_configs_are_refused(adapters, tmp_path, change, message):
    source = adapters["qv8"][0].lora_path
    config = json.loads(Path(source, "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=message):
        read_peft_config(tmp_path, 64)


def test_a_folder_without_the_weights_is_refused(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    with pytest.raises(ValueError, match="has no adapter_model.safetensors"):
        read_peft_config(tmp_path, 64)


def test_adapter_tensors_are_checked_from_the_header_against_the_base_width(adapters, tmp_path):
    config = read_peft_config(adapters["all64"][0].lora_path, 64)
    check_adapter_tensors(config, hidden_size=64)  # the tiny llama's
    with pytest.raises(ValueError, match="does not fit the base model's hidden size 576"):
        check_adapter_tensors(config, hidden_size=576)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    name = "base_model.model.model.embed_tokens.lora_embedding_A"
    save_file({name: torch.zeros(4, 320)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="targets an embedding or LM head, which is not supported"):
        check_adapter_tensors(read_peft_config(tmp_path, 64), hidden_size=64)


def test_ngram_speculation_verifies_with_the_adapters(tiny_checkpoint, adapters):
    """Drafts are verified by the target with each request's adapter: outputs with speculation equal those without,
    which equal transformers + PEFT."""
    path, _ = tiny_checkpoint("llama")
    worker = _worker(path, max_loras=3, block_size=16)  # the block size of the helper's scheduler
    names = ["all8", "base", "qv8"]
    # prompts holding a third of the vocabulary: the tokens the model samples are often in them, so n-grams match
    prompts = [(torch.randperm(317, generator=torch.Generator().manual_seed(i))[:100] + 3).tolist() for i in (0, 1, 2)]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [
        (0, EngineRequest(request_id=f"r{i}", prompt_token_ids=ids, sampling=greedy, lora_request=adapters[name][0]))
        for i, (name, ids) in enumerate(zip(names, prompts, strict=True))
    ]
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    lora = worker.config.lora
    plain, _ = generate(worker, SpeculativeConfig(), requests, num_blocks=NUM_BLOCKS, budget=64, tag="plain", lora=lora)
    spec, scheduler = generate(worker, ngram, requests, num_blocks=NUM_BLOCKS, budget=64, tag="spec", lora=lora)
    assert scheduler.stats().spec_num_draft_tokens > 0  # drafts were verified
    assert spec == plain
    for i, (name, ids) in enumerate(zip(names, prompts, strict=True)):
        assert_greedy_match(plain[f"r{i}"], hf_greedy_reference(adapters[name][1], ids, NEW_TOKENS))
