"""RoPE scaling against transformers: inverse frequencies and cos/sin tables of every rope type, partial rotary,
logits past the original context (YaRN on Llama, LongRoPE on Phi-3), and Phi-3's fused checkpoint tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from tests.helpers.runner_driver import logits_in_chunks
from tests.helpers.tiny_models import randomize_
from tokenmill.config import ModelConfig
from tokenmill.workers.model_loader import iter_weights
from tokenmill.workers.models.layers import RotaryEmbedding, TensorParallel, apply_rotary
from tokenmill.workers.models.registry import architecture_of, model_class
from tokenmill.workers.models.rope import (
    UnsupportedRopeType,
    inverse_frequencies,
    rope_parameters,
    rope_table,
)

CPU = torch.device("cpu")
_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# head_dim 16; Phi-4-mini's partial_rotary_factor 0.75 rotates 12 dims (6 frequencies)
SHORT = [1.0, 1.05, 1.2, 1.6, 2.5, 3.0]
LONG = [1.0, 2.0, 4.5, 9.0, 17.0, 30.0]

ROPE_CASES = {
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=3.0),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    "yarn-untruncated-betas": dict(
        rope_type="yarn",
        rope_theta=50000.0,
        factor=8.0,
        original_max_position_embeddings=64,
        beta_fast=16,
        beta_slow=2,
        truncate=False,
    ),
    "yarn-mscale": dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        mscale=1.0,
        mscale_all_dim=0.5,
    ),
    "yarn-attention-factor": dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, attention_factor=0.8
    ),
    "yarn-partial": dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.75,
    ),
    "llama3": dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
    "longrope": dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=SHORT,
        long_factor=LONG,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.75,
    ),
    "longrope-explicit-factors": dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=SHORT,
        long_factor=LONG,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.75,
        factor=2.0,
        attention_factor=1.3,
    ),
}


def llama_config(rope: dict, max_position_embeddings: int = 256) -> LlamaConfig:
    return LlamaConfig(**_COMMON, max_position_embeddings=max_position_embeddings, rope_parameters=dict(rope))


def phi3_config(max_position_embeddings: int = 1024, **rope) -> Phi3Config:
    """A Phi-3-mini-128k-style config (longrope, original context in `original_max_position_embeddings`), shrunk."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG, **rope}
    return Phi3Config(
        **_COMMON,
        max_position_embeddings=max_position_embeddings,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.75,
        rope_parameters=rope,
        sliding_window=None,
        tie_word_embeddings=False,
    )


def hf_cos_sin(module, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary module on one forward of these positions: cos/sin `[T, rot_dim / 2]` (one half)."""
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = module(x, torch.tensor([positions]))
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inverse_frequencies_and_attention_factor_match_transformers(case):
    rope = ROPE_CASES[case]
    config = (
        phi3_config(**{k: v for k, v in rope.items() if k != "partial_rotary_factor"})
        if rope["rope_type"] == "longrope"
        else llama_config(rope)
    )
    params = rope_parameters(config)
    head_dim = 16
    expected, expected_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, CPU)
    ours, factor = inverse_frequencies(head_dim, params, config.max_position_embeddings, max_model_len=64)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    default, _ = inverse_frequencies(
        head_dim,
        {
            "rope_type": "default",
            "rope_theta": params["rope_theta"],
            "partial_rotary_factor": params.get("partial_rotary_factor", 1.0),
        },
        256,
    )
    if params["rope_type"] != "dynamic":  # dynamic rescales only past max_position_embeddings
        assert not torch.equal(ours, default), "the case must exercise the scaling"
    if params["rope_type"] == "longrope":  # past the original context: the long factors
        expected_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, CPU, seq_len=65)
        ours_long, _ = inverse_frequencies(head_dim, params, config.max_position_embeddings, max_model_len=65)
        torch.testing.assert_close(ours_long, expected_long, rtol=0, atol=0)
        assert not torch.equal(ours_long, ours)


@pytest.mark.parametrize("case", ["linear", "yarn", "yarn-mscale", "yarn-partial", "llama3"])
def test_static_tables_match_transformers_rotary_module(case):
    config = llama_config(ROPE_CASES[case])
    expected_cos, expected_sin = hf_cos_sin(LlamaRotaryEmbedding(config), list(range(300)))
    table = rope_table(16, rope_parameters(config), config.max_position_embeddings, 300)
    cos, sin = table.chunk(2, dim=-1)
    torch.testing.assert_close(cos, expected_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, expected_sin, rtol=1e-6, atol=1e-6)


def test_dynamic_ntk_table_follows_generate_past_max_position_embeddings():
    """generate: a prompt inside max_position_embeddings, then one decode forward per position past it."""
    config = llama_config(ROPE_CASES["dynamic"], max_position_embeddings=64)
    hf = LlamaRotaryEmbedding(config)
    rows = [hf_cos_sin(hf, list(range(40)))]  # the prompt: unscaled base
    rows += [hf_cos_sin(hf, [p]) for p in range(40, 150)]  # decode steps, each recomputing the base past 64
    expected_cos = torch.cat([cos for cos, _ in rows])
    expected_sin = torch.cat([sin for _, sin in rows])
    table = rope_table(16, rope_parameters(config), 64, 150)
    cos, sin = table.chunk(2, dim=-1)
    # one float32 ulp of angles near 100 radians (the per-step base is a 0-d pow in transformers, batched here)
    torch.testing.assert_close(cos, expected_cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(sin, expected_sin, rtol=0, atol=2e-5)
    assert not torch.allclose(cos[100], torch.cos(100 * inverse_frequencies(16, rope_parameters(config), 64)[0]))


def test_longrope_table_is_transformers_for_a_long_prompt_and_for_a_short_context():
    config = phi3_config()
    params = rope_parameters(config)
    # max_model_len past the original 64: long factors everywhere, as transformers' forward over a 150-token prompt
    long_cos, long_sin = hf_cos_sin(Phi3RotaryEmbedding(config), list(range(150)))
    table = rope_table(16, params, 1024, 150, max_model_len=1024)
    assert table.shape == (150, 12)
    torch.testing.assert_close(table, torch.cat([long_cos, long_sin], dim=-1), rtol=1e-6, atol=1e-6)
    # max_model_len inside the original context: short factors, as transformers for any sequence that short
    short_cos, short_sin = hf_cos_sin(Phi3RotaryEmbedding(config), list(range(64)))
    table = rope_table(16, params, 1024, 64, max_model_len=64)
    torch.testing.assert_close(table, torch.cat([short_cos, short_sin], dim=-1), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(long_cos[:64], short_cos)


def test_partial_rotary_leaves_the_tail_dims_and_matches_the_kernel_table():
    rotary = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}, 64)
    assert rotary.rot_dim == 12 and rotary.cos_sin_table().shape == (64, 12)
    x = torch.randn(5, 3, 16)
    cos, sin = rotary.cos_sin(torch.arange(5), torch.float32)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[..., 12:], x[..., 12:], rtol=0, atol=0)
    assert not torch.allclose(out[1:, :, :12], x[1:, :, :12])


def test_unknown_rope_types_fail_naming_them():
    with pytest.raises(UnsupportedRopeType, match="rope type 'proportional' is not supported"):
        RotaryEmbedding(16, {"rope_type": "proportional", "rope_theta": 1e4}, 64)
    with pytest.raises(UnsupportedRopeType, match="'mrope'"):
        inverse_frequencies(16, rope_parameters(SimpleNamespace(rope_scaling={"type": "mrope"})), 64)


def test_the_context_a_rope_scaling_is_made_for_follows_vllm():
    from tokenmill.model_source import rope_scaled_context

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert rope_scaled_context({"rope_scaling": yarn}, 32768) == 131072
    assert rope_scaled_context({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 4096) == 8192
    assert rope_scaled_context({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 4096) == 8192
    longrope = {"rope_type": "longrope", "original_max_position_embeddings": 4096}
    assert rope_scaled_context({"rope_scaling": longrope}, 131072) == 131072
    assert rope_scaled_context({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072) == 131072
    gemma3 = {"model_type": "gemma3_text", "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert rope_scaled_context(gemma3, 131072) == 131072
    assert rope_scaled_context({}, 2048) == 2048


# ---------------------------------------------------------------- whole models past the original context


def save_tiny(config, directory, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.eval().save_pretrained(directory, safe_serialization=True)
    return model


def load_ours(path, hf_config, max_model_len: int, tp: TensorParallel = TensorParallel()):
    model = model_class(architecture_of(hf_config))(hf_config, tp=tp, max_model_len=max_model_len)
    model.load_weights(iter_weights(ModelConfig(path=str(path))))
    return model.eval()


LONG_CONTEXT = {
    "llama-yarn": lambda: llama_config(
        dict(ROPE_CASES["yarn"], beta_fast=16, beta_slow=2), max_position_embeddings=256
    ),
    "phi3-longrope": lambda: phi3_config(max_position_embeddings=1024),
}


@pytest.mark.parametrize("kind", sorted(LONG_CONTEXT))
def test_logits_past_the_original_context_match_transformers(kind, tmp_path):
    config = LONG_CONTEXT[kind]()
    hf_model = save_tiny(config, tmp_path)
    ours = load_ours(tmp_path, hf_model.config, max_model_len=256)
    input_ids = torch.randint(3, 320, (170,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0]
    got = logits_in_chunks(ours, input_ids, [0, 50, 64, 65, 120, 169, 170])  # chunks across position 64, decodes
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # the scaling matters here: the unscaled rotation gives other logits past the original context
    plain = load_ours(
        tmp_path,
        type(config)(**{**config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
        max_model_len=256,
    )
    plain_logits = logits_in_chunks(plain, input_ids, [0, 170])
    assert (plain_logits[100:] - expected[100:]).abs().max() > 1e-2


def test_phi3_fused_tensors_split_per_rank(tmp_path):
    config = phi3_config()
    hf_model = save_tiny(config, tmp_path)
    weights = dict(iter_weights(ModelConfig(path=str(tmp_path))))
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights and "model.layers.0.mlp.gate_up_proj.weight" in weights
    rank1 = load_ours(tmp_path, hf_model.config, max_model_len=256, tp=TensorParallel(rank=1, size=2))
    qkv = weights["model.layers.1.self_attn.qkv_proj.weight"]  # q rows 0-63, k 64-95, v 96-127 (head_dim 16)
    ours = rank1.model.layers[1].self_attn.qkv_proj.weight
    torch.testing.assert_close(ours, torch.cat([qkv[32:64], qkv[80:96], qkv[112:128]]), rtol=0, atol=0)
    gate_up = weights["model.layers.1.mlp.gate_up_proj.weight"]  # gate rows 0-127, up 128-255
    ours = rank1.model.layers[1].mlp.gate_up_proj.weight
    torch.testing.assert_close(ours, torch.cat([gate_up[64:128], gate_up[192:256]]), rtol=0, atol=0)
    short = {**weights, "model.layers.0.self_attn.qkv_proj.weight": qkv[:100]}
    with pytest.raises(ValueError, match="qkv_proj"):
        model_class("Phi3ForCausalLM")(hf_model.config).load_weights(short.items())
