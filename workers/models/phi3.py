"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder with fused checkpoint projections.

The checkpoint stores q/k/v as one `self_attn.qkv_proj` tensor (query rows, then key rows, then value rows) and
gate/up as one `mlp.gate_up_proj` tensor (gate rows, then up rows; the MLP is up * SiLU(gate) as Llama's). They are
split back into the per-projection HF names and loaded through `LlamaForCausalLM.load_weights`, so each rank still
takes its own heads and MLP columns. Partial rotary (`partial_rotary_factor`, 0.75 in Phi-4-mini) and LongRoPE
scaling (Phi-3-*-128k, Phi-4-mini) come from the shared rotary embedding (`workers/models/rope.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenmill.workers.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    QKV_BIAS = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        config = self.config
        q_rows = config.num_attention_heads * self.head_dim
        kv_rows = config.num_key_value_heads * self.head_dim
        for name, tensor in weights:
            module_path, _, param_name = name.rpartition(".")
            parent_path, _, module_name = module_path.rpartition(".")
            if module_name == "qkv_proj" and parent_path.endswith("self_attn"):
                if tensor.shape[0] != q_rows + 2 * kv_rows:
                    raise ValueError(
                        f"{name}: checkpoint has {tensor.shape[0]} rows, expected "
                        f"{q_rows} + 2 * {kv_rows} for the query, key and value heads"
                    )
                for projection, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_rows, kv_rows, kv_rows])):
                    yield f"{parent_path}.{projection}.{param_name}", part
            elif module_name == "gate_up_proj" and parent_path.endswith("mlp"):
                if tensor.shape[0] != 2 * config.intermediate_size:
                    raise ValueError(
                        f"{name}: checkpoint has {tensor.shape[0]} rows, expected "
                        f"2 * intermediate_size = {2 * config.intermediate_size}"
                    )
                gate, up = tensor.chunk(2, dim=0)
                yield f"{parent_path}.gate_proj.{param_name}", gate
                yield f"{parent_path}.up_proj.{param_name}", up
            else:
                yield name, tensor
