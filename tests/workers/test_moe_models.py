"""Mixture-of-experts: the CPU grouped path against a float64 reference, routing against transformers' routers, tiny
Mixtral and Qwen3-MoE models against transformers at every position (CPU path and the Triton path, interpreted),
weight names (per-expert and fused), and the tensor-parallel split of the experts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from tests.helpers.runner_driver import logits_in_chunks
from tests.helpers.tiny_models import randomize_
from tokenmill.config import ModelConfig
from tokenmill.kernels.moe_grouped_gemm import moe_experts_ref
from tokenmill.workers import backends
from tokenmill.workers.model_loader import iter_weights
from tokenmill.workers.models.layers import TensorParallel
from tokenmill.workers.models.moe import MoeExperts, expert_weight_target, grouped_experts, route
from tokenmill.workers.models.registry import architecture_of, model_class

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MOE_CONFIGS = {
    "mixtral": lambda: MixtralConfig(**_COMMON, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2),
    # layer 1 dense (mlp_only_layers), experts unnormalised
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON,
        head_dim=32,
        intermediate_size=96,
        moe_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
    ),
    # every second layer sparse (decoder_sparse_step=2), renormalised top-k
    "qwen3_moe-step2-norm": lambda: Qwen3MoeConfig(
        **_COMMON,
        head_dim=16,
        intermediate_size=80,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        mlp_only_layers=[],
    ),
}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    cache = {}

    def build(kind: str):
        if kind not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(MOE_CONFIGS[kind](), dtype=torch.float32)
            randomize_(model, seed=1)
            path = tmp_path_factory.mktemp(kind)
            model.eval().save_pretrained(path, safe_serialization=True)
            cache[kind] = (path, model)
        return cache[kind]

    return build


def load_ours(weights, hf_config, tp=TensorParallel()):
    model = model_class(architecture_of(hf_config))(hf_config, tp=tp)
    model.load_weights(weights)
    return model.eval()


def routing_case(num_tokens, num_experts, top_k, seed, unused=()):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in unused])
    ids = allowed[torch.rand(num_tokens, len(allowed), generator=g).topk(top_k, dim=-1).indices]
    weights = torch.rand(num_tokens, top_k, generator=g, dtype=torch.float64)
    return ids, weights


@pytest.mark.parametrize("use_grouped_mm", [False, True])
@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, unused", [(1, 4, 2, (1, 2)), (9, 7, 3, (0, 6)), (64, 8, 2, ()), (5, 6, 1, (5,))]
)
def test_cpu_grouped_path_matches_float64_reference(num_tokens, num_experts, top_k, unused, use_grouped_mm):
    g = torch.Generator().manual_seed(num_tokens)
    hidden, inter = 40, 24
    x = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float64)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, dtype=torch.float64) / inter**0.5
    ids, weights = routing_case(num_tokens, num_experts, top_k, num_tokens, unused)
    expected = moe_experts_ref(x, w13, w2, ids, weights)
    got = grouped_experts(x.float(), w13.float(), w2.float(), ids, weights.float(), use_grouped_mm=use_grouped_mm)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_routing_matches_transformers_routers(norm_topk_prob, dtype):
    hidden = torch.randn(37, 64).to(dtype)
    qwen = Qwen3MoeTopKRouter(
        Qwen3MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    ).to(dtype)
    mixtral = MixtralTopKRouter(MixtralConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=2)).to(dtype)
    for router, renormalize, in_logits_dtype in [(qwen, norm_topk_prob, True), (mixtral, True, False)]:
        torch.nn.init.normal_(router.weight)
        logits, expected_weights, expected_ids = router(hidden)
        weights, ids = route(logits, router.top_k, renormalize, in_logits_dtype)
        assert torch.equal(ids, expected_ids)
        assert weights.dtype == expected_weights.dtype
        torch.testing.assert_close(weights, expected_weights, atol=0, rtol=0)


@pytest.mark.parametrize("kind", sorted(MOE_CONFIGS))
def test_logits_match_transformers_at_every_position(moe_checkpoint, kind):
    path, hf_model = moe_checkpoint(kind)
    ours = load_ours(iter_weights(ModelConfig(path=str(path))), hf_model.config)
    kinds = {type(layer.mlp).__name__ for layer in ours.model.layers}
    assert "SparseMoeBlock" in kinds and (kind == "mixtral" or "DecoderMLP" in kinds)
    input_ids = torch.randint(3, 320, (45,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0]
    got = logits_in_chunks(ours, input_ids, [0, 13, 14, 30, 31, 32, 45])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(backends, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    backends.device_kernels.cache_clear()
    yield
    backends.device_kernels.cache_clear()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_triton_grouped_gemm_path_matches_transformers(moe_checkpoint, kind, triton_on_cpu, monkeypatch):
    import tokenmill.workers.models.moe as moe

    path, hf_model = moe_checkpoint(kind)
    ours = load_ours(iter_weights(ModelConfig(path=str(path))), hf_model.config)
    monkeypatch.setattr(moe, "grouped_experts", None)  # the torch path must not run
    input_ids = torch.randint(3, 320, (21,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0]
    got = logits_in_chunks(ours, input_ids, [0, 17, 18, 21])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fused_in_memory_names_load_like_the_per_expert_files(moe_checkpoint):
    path, hf_model = moe_checkpoint("mixtral")
    fused = dict(hf_model.state_dict())  # transformers 5 in memory: mlp.gate, mlp.experts.gate_up_proj [E, 2I, H]
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and "model.layers.0.mlp.gate.weight" in fused
    from_files = load_ours(iter_weights(ModelConfig(path=str(path))), hf_model.config)
    from_fused = load_ours(fused.items(), hf_model.config)
    for (name, a), (_, b) in zip(from_files.state_dict().items(), from_fused.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_expert_weight_names():
    assert expert_weight_target("model.layers.3.block_sparse_moe.experts.5.w3.weight") == (
        "model.layers.3.mlp.experts",
        "w13",
        (5, "up"),
    )
    assert expert_weight_target("model.layers.0.mlp.experts.2.down_proj.weight") == (
        "model.layers.0.mlp.experts",
        "w2",
        (2, "down"),
    )
    assert expert_weight_target("model.layers.1.block_sparse_moe.gate.weight") == (
        "model.layers.1.mlp.gate",
        "weight",
        None,
    )
    assert expert_weight_target("model.layers.1.mlp.experts.gate_up_proj") == (
        "model.layers.1.mlp.experts",
        "w13",
        "fused",
    )
    assert expert_weight_target("model.layers.1.mlp.gate_proj.weight") is None  # a dense layer's: Llama's rules
    with pytest.raises(KeyError):
        expert_weight_target("model.layers.1.mlp.experts.0.bogus.weight")


def test_missing_expert_weight_is_reported(moe_checkpoint):
    path, hf_model = moe_checkpoint("qwen3_moe")
    weights = {
        k: v for k, v in iter_weights(ModelConfig(path=str(path))) if k != "model.layers.2.mlp.experts.7.up_proj.weight"
    }
    with pytest.raises(ValueError, match="layers.2.mlp.experts.w13"):
        load_ours(weights.items(), hf_model.config)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_tensor_parallel_ranks_split_each_experts_intermediate_dim(moe_checkpoint, kind):
    """Two ranks' partial expert outputs sum to the whole; the router is replicated."""
    path, hf_model = moe_checkpoint(kind)
    weights = dict(iter_weights(ModelConfig(path=str(path))))
    full = load_ours(weights.items(), hf_model.config).model.layers[0].mlp
    ranks = [
        load_ours(weights.items(), hf_model.config, TensorParallel(rank, 2)).model.layers[0].mlp for rank in range(2)
    ]
    inter = full.experts.rank_size
    assert all(r.experts.w13.shape[1] == inter and r.experts.w2.shape[2] == inter // 2 for r in ranks)
    torch.testing.assert_close(ranks[1].experts.w2, full.experts.w2[:, :, inter // 2 :], atol=0, rtol=0)
    torch.testing.assert_close(ranks[1].experts.w13[:, : inter // 2], full.experts.w13[:, inter // 2 : inter])
    x = torch.randn(11, 64)
    weights_, ids = route(full.gate(x), full.top_k, full.renormalize, full.weights_in_logits_dtype)
    assert all(torch.equal(r.gate.weight, full.gate.weight) for r in ranks)
    partial_sum = sum(r.experts(x, ids, weights_) for r in ranks)
    torch.testing.assert_close(partial_sum, full(x), atol=1e-5, rtol=1e-5)


def test_moe_experts_reject_an_indivisible_split():
    with pytest.raises(ValueError, match="not divisible"):
        MoeExperts(4, 64, 30, TensorParallel(0, 4))
