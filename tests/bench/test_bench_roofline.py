"""The decode roofline: the model cost formula against a real model's parameters, and the bound's arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
from roofline import MachinePeaks, ModelCost, decode_bound, measure_copy_bandwidth, measure_matmul_flops


def test_matmul_params_equal_the_models_parameters_less_norms(tiny_checkpoints):
    from transformers import AutoConfig, AutoModelForCausalLM

    for family in ("llama", "qwen3"):
        path = tiny_checkpoints(family)
        config = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
        if config.tie_word_embeddings:
            matrices += model.get_input_embeddings().weight.numel()  # the LM head multiplies by the tied table
        cost = ModelCost.from_hf_config(config, weight_bytes=1, dtype_bytes=4)
        assert cost.matmul_params == matrices, family
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        assert cost.kv_bytes_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4


def test_bound_is_memory_limited_at_small_batch_and_compute_limited_at_large():
    cost = ModelCost(
        matmul_params=100_000_000,
        weight_bytes=400_000_000,
        kv_bytes_per_token=40_000,
        attention_flops_per_context_token=60_000,
    )
    machine = MachinePeaks(matmul_flops=1e11, copy_bandwidth=1e10, threads=2)
    small = decode_bound(cost, machine, batch_size=1, context_len=100)
    assert small.limited_by == "memory"
    assert small.step_bytes == 400_000_000 + 100 * 40_000
    assert small.tokens_per_s == pytest.approx(1 / (small.step_bytes / 1e10))
    large = decode_bound(cost, machine, batch_size=1024, context_len=100)
    assert large.limited_by == "compute"
    assert large.step_flops == 1024 * (2e8 + 100 * 60_000)
    assert large.tokens_per_s == pytest.approx(1024 / (large.step_flops / 1e11))
    assert large.tokens_per_s > small.tokens_per_s


def test_machine_measurements_are_positive_and_plausible():
    flops = measure_matmul_flops(size=256, repeats=2)
    bandwidth = measure_copy_bandwidth(num_bytes=64 << 20, repeats=2)
    assert math.isfinite(flops) and 1e8 < flops < 1e15
    assert math.isfinite(bandwidth) and 1e8 < bandwidth < 1e13
