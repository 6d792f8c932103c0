"""LoRA on a quantized base: the default model kept in its GGUF blocks (Q4_1 layers, the CPU kernels with float
activations) with a PEFT adapter on every projection, the delta added in float on top of each quantized matmul, gives
the greedy tokens of transformers (the GGUF dequantized) + PEFT, but for near ties."""

from __future__ import annotations

import pytest

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir
from tests.helpers.lora_adapters import ALL_PROJECTIONS, make_peft_model, save_peft_adapter
from tests.helpers.reference import assert_greedy_match, hf_greedy_reference, load_reference_model
from tests.helpers.runner_driver import run_greedy
from tokenmill.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig
from tokenmill.kernels import gguf_ops
from tokenmill.messages import LoRARequest
from tokenmill.workers.quantization.gguf import GGUFWeight
from tokenmill.workers.worker import Worker

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
NUM_BLOCKS = 64
# float activations: the quantized kernels' logits differ from the dequantized reference's by ~2e-4
# (tests/engine/test_quantized_gguf.py), so a reference margin under 1e-2 is a tie either token may take
NEAR_TIE = 1e-2
PROMPTS = [[1, 504, 3575, 282, 4649, 314], [1, 9690, 253, 33632], [1, 2683, 2137, 13782, 42]]


def test_adapter_on_gguf_weights_matches_dequantized_base_plus_peft(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_ops, "DEFAULT_ACTIVATIONS", "float")
    base = load_reference_model("smollm2", None)  # the GGUF dequantized by transformers, float32, no EOS stop
    peft_model = make_peft_model(base, 16, ALL_PROJECTIONS, seed=7)
    adapter = LoRARequest("gguf-adapter", 1, str(save_peft_adapter(peft_model, tmp_path / "adapter")))
    config = EngineConfig(
        model=ModelConfig(path=str(smollm2_dir()), gguf_file=SMOLLM2_GGUF, dtype="float32"),
        cache=CacheConfig(block_size=16, num_kv_blocks=NUM_BLOCKS),
        parallel=ParallelConfig(device="cpu"),
        lora=LoRAConfig(enable_lora=True, max_loras=1, max_lora_rank=16),
    )
    worker = Worker(config)
    worker.load_model()
    worker.allocate_kv_cache(NUM_BLOCKS)
    assert isinstance(worker.model.model.layers[0].self_attn.qkv_proj.weight, GGUFWeight)  # kept quantized
    loras = [adapter, None, adapter]
    outputs = run_greedy(worker, PROMPTS, NEW_TOKENS, num_blocks=NUM_BLOCKS, lora_requests=loras)
    for lora, prompt, ours in zip(loras, PROMPTS, outputs, strict=True):
        reference = hf_greedy_reference(peft_model if lora else base, prompt, NEW_TOKENS)
        assert assert_greedy_match(ours, reference, NEAR_TIE) >= 4  # tokens compared before the first near tie
    assert outputs[0] != run_greedy(worker, PROMPTS[:1], NEW_TOKENS, num_blocks=NUM_BLOCKS)[0]
