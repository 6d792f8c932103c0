"""The Llama-family decoder against Hugging Face: logits at every position, rope variants, weight loading, registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.helpers.runner_driver import logits_in_chunks
from tests.helpers.tiny_models import TINY_CONFIGS
from tokenmill.config import ModelConfig
from tokenmill.workers.model_loader import iter_weights
from tokenmill.workers.models.layers import TensorParallel, rope_inverse_frequencies
from tokenmill.workers.models.registry import architecture_of, model_class
from tokenmill.workers.models.rope import rope_parameters

CPU = torch.device("cpu")


def load_ours(path, hf_config):
    model = model_class(architecture_of(hf_config))(hf_config)
    model.load_weights(iter_weights(ModelConfig(path=str(path))))
    return model.eval()


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_logits_match_hf_at_every_position(tiny_checkpoint, kind):
    path, hf_model = tiny_checkpoint(kind)
    ours = load_ours(path, hf_model.config)
    input_ids = torch.randint(3, hf_model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0]
    # a prompt in chunks, then single tokens (decode-only steps)
    got = logits_in_chunks(ours, input_ids, [0, 13, 14, 30, 31, 32, 45])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_llama3_inverse_frequencies_match_hf():
    config = TINY_CONFIGS["llama3-rope"]()
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, CPU)
    head_dim = config.hidden_size // config.num_attention_heads
    ours = rope_inverse_frequencies(head_dim, rope_parameters(config), config.max_position_embeddings)
    default = rope_inverse_frequencies(head_dim, {"rope_type": "default", "rope_theta": 500000.0}, 512)
    assert not torch.allclose(ours, default), "the test config must exercise the scaling"
    torch.testing.assert_close(ours, expected)


def test_rope_parameters_accept_the_old_spelling():
    old = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old) == {"type": "linear", "factor": 2.0, "rope_theta": 500000.0, "rope_type": "linear"}
    plain = rope_parameters(SimpleNamespace(rope_theta=1e4, rope_scaling=None))
    assert plain == {"rope_theta": 1e4, "rope_type": "default"}
    unscaled = rope_inverse_frequencies(8, {"rope_type": "default", "rope_theta": 500000.0}, 512)
    torch.testing.assert_close(rope_inverse_frequencies(8, rope_parameters(old), 512) * 2.0, unscaled)
    with pytest.raises(NotImplementedError, match="'su'"):
        rope_inverse_frequencies(8, {"rope_type": "su", "rope_theta": 1e4}, 512)


def test_load_weights_rejects_missing_unknown_and_misshapen(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("llama")
    weights = dict(iter_weights(ModelConfig(path=str(path))))
    cls = model_class("LlamaForCausalLM")

    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match="qkv_proj"):
        cls(hf_model.config).load_weights(missing.items())
    with pytest.raises(KeyError, match="bogus"):
        cls(hf_model.config).load_weights([*weights.items(), ("model.bogus.weight", torch.zeros(1))])
    misshapen = dict(weights, **{"model.norm.weight": torch.ones(1, 64)})
    with pytest.raises(ValueError, match="shape"):
        cls(hf_model.config).load_weights(misshapen.items())


def test_per_rank_head_counts_for_a_tensor_parallel_split(tiny_checkpoint):
    _, hf_model = tiny_checkpoint("llama")  # 4 query heads, 2 kv heads, intermediate 128
    rank1 = model_class("LlamaForCausalLM")(hf_model.config, tp=TensorParallel(rank=1, size=2))
    attention = rank1.model.layers[0].self_attn
    assert (attention.num_heads, attention.num_kv_heads, rank1.num_kv_heads) == (2, 1, 1)
    assert rank1.model.layers[0].mlp.gate_up_proj.weight.shape == (128, 64)
    assert attention.o_proj.weight.shape == (64, 32)
    # rank 1 owns query heads 2-3 and kv head 1 of the full q/k projections
    full_q = torch.arange(64 * 64, dtype=torch.float32).view(64, 64)
    attention.qkv_proj.load("weight", full_q, "q")
    torch.testing.assert_close(attention.qkv_proj.weight[:32], full_q[32:])
    full_k = torch.arange(32 * 64, dtype=torch.float32).view(32, 64)
    attention.qkv_proj.load("weight", full_k, "k")
    torch.testing.assert_close(attention.qkv_proj.weight[32:48], full_k[16:])


def test_registry():
    assert model_class("Qwen3ForCausalLM").QK_NORM
    assert model_class("Qwen2ForCausalLM").QKV_BIAS
    assert architecture_of(SimpleNamespace(architectures=None, model_type="mistral")) == "MistralForCausalLM"
    several = SimpleNamespace(architectures=["Foo", "LlamaForCausalLM"], model_type="llama")
    assert architecture_of(several) == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="unsupported"):
        architecture_of(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ValueError, match="unsupported"):
        model_class("GPT2LMHeadModel")
