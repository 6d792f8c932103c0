"""Gemma 3 text decoders against transformers: logits at every position, for the text-only checkpoint and for the
multimodal (Gemma3ForConditionalGeneration) layout, whose vision weights are skipped at load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.runner_driver import logits_in_chunks
from tests.helpers.tiny_models import randomize_
from tokenmill.config import ModelConfig
from tokenmill.workers.model_loader import iter_weights, load_hf_config
from tokenmill.workers.models.gemma3 import FULL, SLIDING, gemma_rope_parameters, layer_types
from tokenmill.workers.models.registry import architecture_of, model_class

# Both layer kinds, global RoPE with linear scaling (as Gemma 3 4B+), a query scale unlike head_dim ** -0.5, final
# logit softcapping on (Gemma 3 checkpoints leave it off; the code path must still be right).
TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    max_position_embeddings=512,
    layer_types=[SLIDING, SLIDING, FULL, SLIDING],
    sliding_window=64,
    rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
    final_logit_softcapping=30.0,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
VISION = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


def build(kind: str, directory):
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

    torch.manual_seed(0)
    if kind.startswith("text"):
        text = dict(TEXT, sliding_window=16) if kind == "text-window16" else TEXT
        model = Gemma3ForCausalLM(Gemma3TextConfig(**text, architectures=["Gemma3ForCausalLM"]))
    else:
        config = Gemma3Config(
            text_config=TEXT,
            vision_config=VISION,
            mm_tokens_per_image=4,
            image_token_index=300,
            boi_token_index=301,
            eoi_token_index=302,
            architectures=["Gemma3ForConditionalGeneration"],
        )
        model = Gemma3ForConditionalGeneration(config)
    randomize_(model, 0)  # norm weights ~1 (so (1 + w) ~ 2 is told apart from w), nothing left at zero
    model.float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    made = {}

    def get(kind: str):
        if kind not in made:
            directory = tmp_path_factory.mktemp(f"gemma3-{kind}")
            made[kind] = (directory, build(kind, directory))
        return made[kind]

    return get


def load_ours(path):
    model_cfg = ModelConfig(path=str(path))
    hf_config = load_hf_config(model_cfg)
    model = model_class(architecture_of(hf_config))(hf_config)
    model.load_weights(iter_weights(model_cfg))
    return model.eval()


@pytest.mark.parametrize("backend", ["kernels", "torch"])
@pytest.mark.parametrize("kind", ["text", "multimodal", "text-window16"])
def test_logits_match_hf_at_every_position(gemma3, use_cpu_backend, backend, kind):
    """45 tokens: inside the 64-key window, and (text-window16) well past a 16-key one."""
    use_cpu_backend(backend)
    path, hf_model = gemma3(kind)
    ours = load_ours(path)
    assert type(ours).__name__ == ("Gemma3ForConditionalGeneration" if kind == "multimodal" else "Gemma3ForCausalLM")
    input_ids = torch.randint(3, 300, (45,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0].float()
    got = logits_in_chunks(ours, input_ids, [0, 13, 14, 30, 31, 32, 45])
    assert got.dtype == torch.float32
    if kind != "multimodal":  # transformers' Gemma3ForConditionalGeneration ignores final_logit_softcapping
        assert got.abs().max() < 30.0
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# HF name (after `model.layers.N.`) -> llama.cpp's gemma3 tensor name
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gemma3_gguf(hf_model, file):
    """What llama.cpp's convert_hf_to_gguf.py writes for a Gemma 3 text model (F32): its names, norms as 1 + w."""
    import gguf

    c = hf_model.config
    writer = gguf.GGUFWriter(str(file), "gemma3")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(c.sliding_window)
    writer.add_vocab_size(c.vocab_size)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight":
            continue
        base = name.removesuffix(".weight")
        if base in ("model.embed_tokens", "model.norm"):
            gguf_name = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}[base]
        else:
            parts = base.split(".")
            gguf_name = f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:])]}"
        array = tensor.float().numpy().copy()
        writer.add_tensor(f"{gguf_name}.weight", array + 1 if name.endswith("norm.weight") else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_loads_and_matches_transformers_reading_it(gemma3, tmp_path):
    """llama.cpp's names and 1 + w norms map back to the HF weights; logits equal transformers' own GGUF load (whose
    config, read from GGUF metadata, has the default layer pattern and query_pre_attn_scalar)."""
    from transformers import AutoModelForCausalLM

    path, hf_model = gemma3("text")
    write_gemma3_gguf(hf_model, tmp_path / "tiny.gguf")
    model_cfg = ModelConfig(path=str(tmp_path), gguf_file="tiny.gguf")
    expected_weights = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    got_weights = dict(iter_weights(model_cfg))
    assert got_weights.keys() == expected_weights.keys()
    for name, tensor in got_weights.items():
        torch.testing.assert_close(tensor, expected_weights[name], msg=name)

    hf_config = load_hf_config(model_cfg)
    assert architecture_of(hf_config) == "Gemma3ForCausalLM"
    ours = model_class(architecture_of(hf_config))(hf_config)
    ours.load_weights(iter_weights(model_cfg))
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    input_ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(input_ids[None]).logits[0].float()
    got = logits_in_chunks(ours.eval(), input_ids, [0, 17, 18, 40])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_load_rejects_a_missing_norm(gemma3):
    path, _ = gemma3("text")
    weights = dict(iter_weights(ModelConfig(path=str(path))))
    weights.pop("model.layers.2.pre_feedforward_layernorm.weight")
    model = model_class("Gemma3ForCausalLM")(load_hf_config(ModelConfig(path=str(path))))
    with pytest.raises(ValueError, match="pre_feedforward_layernorm"):
        model.load_weights(weights.items())


def test_layer_types_and_rope_from_older_config_spellings():
    old = SimpleNamespace(
        num_hidden_layers=7,
        sliding_window_pattern=3,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    assert layer_types(old) == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING]
    assert gemma_rope_parameters(old, SLIDING) == {"rope_type": "default", "rope_theta": 1e4}
    assert gemma_rope_parameters(old, FULL) == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}


def test_registry_maps_gemma3_model_types():
    assert architecture_of(SimpleNamespace(architectures=None, model_type="gemma3_text")) == "Gemma3ForCausalLM"
    assert architecture_of(SimpleNamespace(architectures=None, model_type="gemma3")) == "Gemma3ForConditionalGeneration"
