"""Gemma 3 through the whole engine (offline `LLM`, float32, chunked prefill with a small token budget, prefix
caching on): greedy tokens identical to transformers' `generate`, for a text-only checkpoint (Gemma3ForCausalLM)
and for the multimodal layout (Gemma3ForConditionalGeneration: text_config, language_model. prefixes, a vision
tower that is skipped). The tiny models have local layers with a 32-key window; some prompts are longer than it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.checkpoints import TINY_CONFIGS
from tests.helpers.reference import assert_greedy_match, hf_greedy_reference

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
WINDOW = TINY_CONFIGS["gemma3"]["sliding_window"]
SHARED = (
    "You are a careful assistant. Answer briefly and precisely, cite no sources, and never apologise. "
    "The user is a student preparing for an exam in European geography and history. "
)
TEXTS = [
    "Hi",
    "The capital of France is",
    "Q: What is 12 times 12?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his "
    "daughter. Every morning the woodcutter walked into the forest with his axe, and every evening he came back",
]
SHARED_QUESTIONS = ["What is the capital of Spain?", "Name a river in Germany."]


def build_multimodal(root, tokenizer):
    """The tiny gemma3 family's text model inside a Gemma3ForConditionalGeneration with a dummy SigLIP tower."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    path = root / "gemma3-multimodal"
    extra = {k: v for k, v in TINY_CONFIGS["gemma3"].items() if k not in ("architectures", "model_type")}
    extra.pop("final_logit_softcapping")  # transformers' Gemma3ForConditionalGeneration ignores it
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.1,
        **extra,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=3,
        boi_token_index=4,
        eoi_token_index=5,
        architectures=["Gemma3ForConditionalGeneration"],
        initializer_range=0.1,
    )
    torch.manual_seed(1)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # Gemma initialises its (1 + w) norms at w = 0: make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def reference_model(kind, path):
    from transformers import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    cls = Gemma3ForCausalLM if kind == "text" else Gemma3ForConditionalGeneration
    model = cls.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos: so must the reference
    return model.eval()


@pytest.mark.parametrize("kind", ["text", "multimodal"])
def test_gemma3_greedy_matches_transformers(kind, tiny_checkpoints, smollm2_tokenizer, tmp_path):
    from tokenmill import LLM, SamplingParams

    if kind == "text":
        path = tiny_checkpoints("gemma3")
    else:
        path = build_multimodal(tmp_path, smollm2_tokenizer)
    prompts = [smollm2_tokenizer.encode(t) for t in TEXTS]
    shared = [smollm2_tokenizer.encode(SHARED * 2 + q) for q in SHARED_QUESTIONS]
    assert max(len(p) for p in prompts) > WINDOW and min(len(p) for p in shared) > WINDOW
    assert min(len(p) for p in prompts) + NEW_TOKENS < WINDOW  # some sequences stay inside the window throughout

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(
        str(path), dtype="float32", max_model_len=1024, max_num_batched_tokens=16, enable_prefix_caching=True
    ) as llm:
        results = llm.generate(prompts + shared[:1], params, use_tqdm=False)
        results += llm.generate(shared[1:], params, use_tqdm=False)  # its shared prefix is cached by now

    hf_model = reference_model(kind, path)
    compared = []
    for ids, result in zip(prompts + shared, results):
        ours = result.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS
        compared.append(assert_greedy_match(ours, hf_greedy_reference(hf_model, ids, NEW_TOKENS)))
    assert sum(compared) >= len(compared) * NEW_TOKENS // 2, f"too few tokens compared: {compared}"
    shared_blocks = len(smollm2_tokenizer.encode(SHARED * 2)) // 16
    assert results[-1].num_cached_tokens >= (shared_blocks - 1) * 16
