"""AWQ, GPTQ (act-order), FP8 and compressed-tensors (int4, FP8) checkpoints of a tiny Llama, made by the test
quantizer (tests/helpers/quantized_checkpoints.py): what each reader builds from them; the model holding those quantized
weights (fused, and sharded for two ranks) against the model on the dense checkpoint of the same dequantized weights;
and the engine's greedy output on CPU, which dequantizes at load, against transformers' on that dense checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.quantized_checkpoints import QUANTIZED_LAYER, write_quantized_checkpoint
from tests.helpers.runner_driver import logits_in_chunks
from tokenmill.config import ModelConfig
from tokenmill.workers.model_loader import iter_weights, load_hf_config
from tokenmill.workers.models.registry import architecture_of, model_class
from tokenmill.workers.quantization import checkpoint_reader
from tokenmill.workers.quantization.awq import AWQWeight
from tokenmill.workers.quantization.base import QuantizedWeight
from tokenmill.workers.quantization.fp8 import FP8Weight
from tokenmill.workers.quantization.gptq import GPTQWeight

METHODS = {  # method -> (writer options, the QuantizedWeight class, the tensor parts of one layer)
    "awq": (dict(group_size=32), AWQWeight, ("qweight", "qzeros", "scales")),
    "gptq": (dict(group_size=32, desc_act=True), GPTQWeight, ("qweight", "qzeros", "scales", "g_idx")),
    "fp8": (dict(per_channel=True), FP8Weight, ("weight", "weight_scale")),
    # compressed-tensors: asymmetric int4 with group act-order, and per-tensor FP8 with a static input scale
    "compressed-int4": (
        dict(group_size=32, desc_act=True),
        GPTQWeight,
        ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx"),
    ),
    "compressed-fp8": (
        dict(per_channel=False, static_input_scale=True),
        FP8Weight,
        ("weight", "weight_scale", "input_scale"),
    ),
}


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    """method -> (quantized dir, dense reference dir, the quantized checkpoint's tensors)."""
    dense = tiny_checkpoints("llama")
    root = tmp_path_factory.mktemp("quantized")
    made = {}
    for method, (options, _, _) in METHODS.items():
        out, reference = root / method, root / f"{method}-dequantized"
        made[method] = out, reference, write_quantized_checkpoint(dense, out, reference, method, **options)
    return made


def read(path) -> dict:
    config = json.loads((path / "config.json").read_text())
    method = config["quantization_config"]["quant_method"]
    return dict(checkpoint_reader(method)(ModelConfig(path=str(path))))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_reader_groups_each_layer_into_one_quantized_weight(quantized, method):
    path, reference_path, tensors = quantized[method]
    _, cls, parts = METHODS[method]
    weights = read(path)
    reference = dict(iter_weights(ModelConfig(path=str(reference_path))))
    assert set(weights) == set(reference)  # every part folded into `<layer>.weight`, nothing else renamed or lost
    layers = [name for name in weights if QUANTIZED_LAYER.fullmatch(name)]
    assert len(layers) == 2 * 7
    for name in layers:
        weight = weights[name]
        assert isinstance(weight, cls) and weight.shape == reference[name].shape, name
        prefix = name.removesuffix(".weight")
        stored = sum(tensors[f"{prefix}.{part}"].nbytes for part in parts)
        if method in ("gptq", "compressed-int4"):  # act-order: the shuffled g_idx is kept (a plain one is dropped)
            assert weight.g_idx is not None
        assert weight.nbytes() == stored, name
        torch.testing.assert_close(weight.dequantize(torch.float32), reference[name], rtol=0, atol=0)
    assert not any(isinstance(weights[name], QuantizedWeight) for name in weights if name not in layers)
    dense_bytes = sum(reference[name].numel() * 2 for name in layers)  # what fp16 weights would take
    quantized_bytes = sum(weights[name].nbytes() for name in layers)
    assert quantized_bytes < dense_bytes * (0.6 if method.endswith("fp8") else 0.4)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_model_on_quantized_weights_matches_dequantized_checkpoint(quantized, method):
    """The layers hold the reader's QuantizedWeights (q/k/v and gate/up fused by concat_rows) and run their CPU
    matmul: logits as the model on the dense dequantized checkpoint."""
    path, reference_path, _ = quantized[method]
    hf_config = load_hf_config(ModelConfig(path=str(reference_path)))
    cls = model_class(architecture_of(hf_config))
    ours, dense = cls(hf_config), cls(hf_config)
    ours.load_weights(read(path).items())
    dense.load_weights(iter_weights(ModelConfig(path=str(reference_path))))
    layer = ours.model.layers[0]
    _, weight_cls, _ = METHODS[method]
    assert isinstance(layer.self_attn.qkv_proj.weight, weight_cls)  # fused into one weight, not stacked
    assert isinstance(layer.mlp.gate_up_proj.weight, weight_cls)
    assert isinstance(layer.mlp.down_proj.weight, weight_cls)
    input_ids = torch.randint(3, hf_config.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    expected = logits_in_chunks(dense.eval(), input_ids, [0, 13, 20, 21])
    got = logits_in_chunks(ours.eval(), input_ids, [0, 13, 20, 21])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_cpu_loads_dequantize_and_cuda_loads_keep_the_format(quantized, caplog):
    path, reference_path, _ = quantized["gptq"]
    model_cfg = ModelConfig(path=str(path), quantization="gptq")
    reference = dict(iter_weights(ModelConfig(path=str(reference_path))))
    with caplog.at_level("INFO"):
        on_cpu = dict(iter_weights(model_cfg, "cpu"))
    assert [r.getMessage() for r in caplog.records if "dequantizing" in r.getMessage()] == [
        "dequantizing the gptq weights to float32 at load (on cpu)"
    ]
    assert set(on_cpu) == set(reference)
    for name, tensor in on_cpu.items():
        assert isinstance(tensor, torch.Tensor), name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
    on_cuda = dict(iter_weights(model_cfg, "cuda"))  # the reader builds them on the CPU; nothing touches a GPU here
    assert sum(isinstance(weight, GPTQWeight) for weight in on_cuda.values()) == 2 * 7


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8"])
def test_tensor_parallel_shards_are_the_dense_shards(quantized, method):
    """Each of two ranks slices the quantized weights (q/k/v heads and gate/up columns by rows, o_proj/down_proj by
    cols on group boundaries) into exactly its share of the dense weights."""
    from tokenmill.workers.models.layers import TensorParallel

    path, reference_path, _ = quantized[method]
    hf_config = load_hf_config(ModelConfig(path=str(reference_path)))
    cls = model_class(architecture_of(hf_config))
    for rank in (0, 1):
        ours, dense = cls(hf_config, tp=TensorParallel(rank, 2)), cls(hf_config, tp=TensorParallel(rank, 2))
        ours.load_weights(read(path).items())
        dense.load_weights(iter_weights(ModelConfig(path=str(reference_path))))
        sharded = [
            (name, module.weight)
            for name, module in ours.named_modules()
            if isinstance(getattr(module, "weight", None), QuantizedWeight)
        ]
        assert len(sharded) == 2 * 4  # qkv, o, gate_up, down per layer
        for name, weight in sharded:
            expected = dense.get_submodule(name).weight
            assert weight.shape == expected.shape, name
            torch.testing.assert_close(weight.dequantize(torch.float32), expected, rtol=0, atol=0)


def test_bad_quantization_configs_are_clear_errors(tmp_path):
    config = {"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bits=8: only 4-bit"):
        next(checkpoint_reader("gptq")(ModelConfig(path=str(tmp_path))))
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="block-scaled FP8"):
        next(checkpoint_reader("fp8")(ModelConfig(path=str(tmp_path))))
    from safetensors.torch import save_file

    save_file(
        {"proj.qweight": torch.zeros(64, 4, dtype=torch.int32), "proj.scales": torch.ones(2, 32).half()},
        str(tmp_path / "model.safetensors"),
    )
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"proj.qweight but no proj.qzeros \(zero_point is true\)"):
        next(checkpoint_reader("awq")(ModelConfig(path=str(tmp_path))))
    config["quantization_config"]["zero_point"] = False  # then the codes are offset by 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    name, weight = next(checkpoint_reader("awq")(ModelConfig(path=str(tmp_path))))
    assert name == "proj.weight" and torch.equal(weight.dequantize(), torch.full((32, 64), -8.0))


@pytest.mark.slow
def test_engine_greedy_on_quantized_checkpoints_matches_dense(quantized, smollm2_tokenizer):
    """On CPU the engine dequantizes each checkpoint at load: its greedy tokens are those of the dense checkpoint of
    the same weights (float32; transformers' greedy on it is the reference, as for every dense model)."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.reference import assert_greedy_match, hf_greedy_reference
    from tokenmill import LLM, SamplingParams

    prompts = [smollm2_tokenizer.encode(text) for text in ("The quick brown fox", "Quantized weights are")]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for method in ("awq", "gptq", "fp8"):
        path, reference_path, _ = quantized[method]
        with LLM(str(path), dtype="float32", max_model_len=256, device="cpu") as llm:
            assert llm.config.model.quantization == method
            outputs = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        hf_model = AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32).eval()
        hf_model.generation_config.eos_token_id = None  # the engine runs with ignore_eos: so must the reference
        compared = [
            assert_greedy_match(ours, hf_greedy_reference(hf_model, ids, 12)) for ours, ids in zip(outputs, prompts)
        ]
        assert sum(compared) >= 12, (method, compared)
