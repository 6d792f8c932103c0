"""Qwen3-MoE: the Qwen3 decoder (per-head q/k norm) with sparse mixture-of-experts MLPs (`workers/models/moe.py`).

Layer i is sparse when it is not in `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`, else a
dense MLP of `intermediate_size`; experts have `moe_intermediate_size`. Routing: softmax over all experts in float32,
top-k, renormalised when `norm_topk_prob`, weights cast back to the model dtype, as transformers'
`Qwen3MoeTopKRouter`. There is no shared expert. Weights load from `mlp.experts.N.gate_proj/up_proj/down_proj`
(published checkpoints and `save_pretrained`) or transformers' fused `mlp.experts.gate_up_proj` / `down_proj`.
"""

from __future__ import annotations

from torch import nn

from tokenmill.workers.models.llama import Qwen3ForCausalLM
from tokenmill.workers.models.moe import SparseMoeBlock, expert_weight_target


def num_experts(config) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


def is_sparse_layer(config, layer_index: int) -> bool:
    """transformers' rule for which Qwen3-MoE layers have experts."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_index not in (getattr(config, "mlp_only_layers", None) or [])
        and num_experts(config) > 0
        and (layer_index + 1) % step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer_index: int) -> nn.Module | None:
        config = self.config
        if not is_sparse_layer(config, layer_index):
            return None  # the dense DecoderMLP (intermediate_size)
        return SparseMoeBlock(
            config.hidden_size,
            num_experts(config),
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            weights_in_logits_dtype=True,
            tp=self.tp,
        )

    def weight_target(self, name: str) -> tuple[str, str, object]:
        return expert_weight_target(name) or super().weight_target(name)
