"""Mixture-of-experts layers (Mixtral, Qwen3-MoE): a replicated router, top-k routing, and expert weights stacked per
layer and computed grouped by expert.

Routing follows transformers exactly: router logits in the model dtype, softmax over every expert in float32, top-k,
then (Mixtral always, Qwen3-MoE when `norm_topk_prob`) renormalised over the k chosen; Mixtral keeps the weights in
float32, Qwen3-MoE casts them back to the model dtype. (Mixtral's softmax-then-renormalise is the softmax over the
top-k logits.)

Experts: `w13 [E, 2 * I_rank, H]` (each expert's gate rows, then its up rows) and `w2 [E, H, I_rank]`. With tensor
parallelism every rank holds every expert with its intermediate dimension split (vLLM's FusedMoE TP): the gate/up
rows and the down columns of the rank's slice; each rank's weighted sum is partial and one all-reduce after the down
projection completes it. The router is replicated.

Where they run: on a device whose `LayerOps` offer `moe_experts` (CUDA: the Triton grouped GEMM of
`kernels/moe_grouped_gemm.py`), that kernel; otherwise the torch grouped path below: the (token, k) pairs sorted by
expert, then, for decode-sized batches, torch's `grouped_mm` over all the sorted rows in one call, and for larger ones
one matmul per active expert over its contiguous slice of rows (measured: `CPU_GROUPED_MM_MAX_PAIRS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.workers.backends import layer_ops
from tokenmill.workers.models.layers import ReplicatedLoad, TensorParallel, copy_checked, new_parameter
from tokenmill.workers.models.packed_linear import linear

# The torch grouped path takes `grouped_mm` (one call over all the sorted rows) for up to this many (token, k) pairs
# and one torch.mm per active expert above it: `scripts/bench_moe_cpu.py` on an OLMoE-sized layer (64 experts, top-8,
# hidden 2048, float32, 2 threads) timed a batch-32 decode (256 pairs) faster with grouped_mm in every run (161 vs
# 168 ms on an idle machine, 1.3-5x under load) and a 512-token prefill (4096 pairs) faster with the loop on an idle
# machine (1.88 vs 2.75 s; within 5-20% either way under load).
CPU_GROUPED_MM_MAX_PAIRS = 1024


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_in_logits_dtype: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from router logits [T, E], as transformers' top-k routers compute them."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_logits_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    kernel = layer_ops(x.device.type).silu_and_mul
    if kernel is not None:
        return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token, grouped by expert; returns [T, H].

    The pairs are sorted by expert (stably, so each token's pairs are summed in expert order, as transformers does);
    each pair's output is scaled by its weight (in float32 when the weights are) and rounded to x's dtype before the
    sum.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_row = order // top_k
    rows = x.index_select(0, token_of_row)
    counts = torch.bincount(flat, minlength=num_experts)
    if use_grouped_mm is None:
        use_grouped_mm = flat.numel() <= CPU_GROUPED_MM_MAX_PAIRS and hasattr(F, "grouped_mm")
    if use_grouped_mm:
        offsets = counts.cumsum(0).to(torch.int32)
        gate_up = F.grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
        out = F.grouped_mm(_silu_and_mul(gate_up), w2.transpose(1, 2), offs=offsets)
    else:
        out = torch.empty(rows.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            end = start + count
            gate_up = torch.mm(rows[start:end], w13[expert].t())
            torch.mm(_silu_and_mul(gate_up), w2[expert].t(), out=out[start:end])
            start = end
    scaled = (out * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros(num_tokens, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, token_of_row, scaled)


class MoeRouter(ReplicatedLoad, nn.Module):
    """The gate: hidden [T, H] -> router logits [T, E], in the model dtype, replicated on every rank."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = new_parameter(num_experts, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class MoeExperts(nn.Module):
    """Every expert's gate/up and down weights, stacked, with this rank's slice of each intermediate dimension.

    `load` takes one expert's tensor (shard id `(expert, "gate" | "up" | "down")`, the per-expert checkpoint names)
    or all experts at once (shard id "fused": transformers' `experts.gate_up_proj [E, 2I, H]`, `experts.down_proj
    [E, H, I]`).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.rank_size = tp.split(intermediate_size, "moe intermediate size")
        self.first_column = tp.rank * self.rank_size
        self.w13 = new_parameter(num_experts, 2 * self.rank_size, hidden_size)
        self.w2 = new_parameter(num_experts, hidden_size, self.rank_size)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        kernel = layer_ops(x.device.type).moe_experts
        if kernel is not None:
            return kernel(x, self.w13, self.w2, topk_ids, topk_weights)
        return grouped_experts(x, self.w13, self.w2, topk_ids, topk_weights)

    def load(self, param_name: str, full: torch.Tensor, shard_id) -> int:
        first, size, inter = self.first_column, self.rank_size, self.intermediate_size
        if shard_id == "fused":
            if param_name == "w2":
                return copy_checked(self.w2.data, full.narrow(2, first, size), "experts.down_proj")
            if full.dim() != 3 or full.shape[1] != 2 * inter:
                raise ValueError(
                    f"experts.gate_up_proj: checkpoint shape {tuple(full.shape)} is not "
                    f"[{self.num_experts}, {2 * inter}, hidden]"
                )
            written = copy_checked(self.w13.data[:, :size], full.narrow(1, first, size), "experts.gate_up_proj")
            return written + copy_checked(
                self.w13.data[:, size:], full.narrow(1, inter + first, size), "experts.gate_up_proj"
            )
        expert, kind = shard_id
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"expert {expert} is out of range: the config has {self.num_experts} experts")
        what = f"experts.{expert}.{kind}"
        if kind == "down":
            return copy_checked(self.w2.data[expert], full.narrow(1, first, size), what)
        dest_row = 0 if kind == "gate" else size
        return copy_checked(self.w13.data[expert, dest_row : dest_row + size], full.narrow(0, first, size), what)


class SparseMoeBlock(nn.Module):
    """Router + experts + the tensor-parallel all-reduce: hidden [T, H] -> [T, H]."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        weights_in_logits_dtype: bool,
        tp: TensorParallel,
    ):
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_logits_dtype = weights_in_logits_dtype
        self.gate = MoeRouter(hidden_size, num_experts)
        self.experts = MoeExperts(num_experts, hidden_size, intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.weights_in_logits_dtype)
        return self.tp.all_reduce(self.experts(x, ids, weights))


# HF expert projection name -> (stacked parameter, shard kind): Qwen3-MoE's names, then Mixtral's
_EXPERT_PROJECTIONS = {
    "gate_proj": ("w13", "gate"),
    "up_proj": ("w13", "up"),
    "down_proj": ("w2", "down"),
    "w1": ("w13", "gate"),
    "w3": ("w13", "up"),
    "w2": ("w2", "down"),
}
_FUSED_EXPERT_TENSORS = {"gate_up_proj": "w13", "down_proj": "w2"}


def expert_weight_target(name: str) -> tuple[str, str, object] | None:
    """Where an MoE checkpoint tensor loads: (module path, parameter, shard id), or None for any other tensor.

    Accepts the per-expert names of published checkpoints and of transformers' `save_pretrained`
    (`model.layers.N.mlp.experts.E.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.E.w1.weight`), the fused
    tensors of transformers' in-memory modules (`model.layers.N.mlp.experts.gate_up_proj`), and Mixtral's router
    `block_sparse_moe.gate.weight`; Mixtral's `block_sparse_moe` is this model's `mlp`.
    """
    parts = name.split(".")
    if "block_sparse_moe" in parts:
        parts[parts.index("block_sparse_moe")] = "mlp"
    if "experts" not in parts:
        if parts[-2:] == ["gate", "weight"] and len(parts) >= 3 and parts[-3] == "mlp":
            return ".".join(parts[:-1]), "weight", None
        return None
    at = parts.index("experts")
    module_path = ".".join(parts[: at + 1])
    rest = parts[at + 1 :]
    if len(rest) == 1 and rest[0] in _FUSED_EXPERT_TENSORS:
        return module_path, _FUSED_EXPERT_TENSORS[rest[0]], "fused"
    if len(rest) == 3 and rest[0].isdigit() and rest[1] in _EXPERT_PROJECTIONS and rest[2] == "weight":
        param, kind = _EXPERT_PROJECTIONS[rest[1]]
        return module_path, param, (int(rest[0]), kind)
    raise KeyError(f"checkpoint tensor {name!r} is not an expert weight this model knows")
