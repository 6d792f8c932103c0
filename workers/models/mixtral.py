"""Mixtral: the Llama decoder with every layer's MLP a sparse mixture of experts (`workers/models/moe.py`).

Routing: softmax over all experts in float32, top-k, renormalised over the k (the softmax of the top-k logits), the
weights kept in float32, as transformers' `MixtralTopKRouter`. Weights load from `block_sparse_moe.experts.N.w1/w2/w3`
and `block_sparse_moe.gate` (published checkpoints and `save_pretrained`) or transformers' fused
`mlp.experts.gate_up_proj` / `down_proj`.
"""

from __future__ import annotations

from torch import nn

from tokenmill.workers.models.llama import LlamaForCausalLM
from tokenmill.workers.models.moe import SparseMoeBlock, expert_weight_target


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer_index: int) -> nn.Module | None:
        config = self.config
        return SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=True,
            weights_in_logits_dtype=False,
            tp=self.tp,
        )

    def weight_target(self, name: str) -> tuple[str, str, object]:
        return expert_weight_target(name) or super().weight_target(name)
