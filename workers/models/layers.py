"""Building blocks shared by the decoder models: RMSNorm, rotary embeddings, and linear layers split per rank.

Tensor parallelism is local to these layers: a `TensorParallel` (rank, size) tells each layer which slice of a
full Hugging Face weight it owns; column-split layers (fused QKV, fused gate/up) keep their per-rank output rows,
row-split layers (o_proj, down_proj) keep their per-rank input columns and all-reduce their output; the embedding
and the LM head are vocab-parallel (each rank holds a slice of the vocabulary's rows: lookups are all-reduced,
logits all-gathered). With size 1 every slice is the whole tensor and no collective runs.

RMSNorm, the rotary embedding and SiLU-and-mul run their torch code below unless the device's `LayerOps`
(`workers/ops.py`, picked by `workers/backends.py`) offer a fused kernel: Triton on CUDA, the compiled CPU kernels on
CPU.

Every layer with parameters has `load(param_name, full_tensor, shard_id)`, which copies its rank's slice of a
checkpoint tensor into the parameter (shape-checked) and returns how many elements it wrote, so the model can
verify that every parameter was filled exactly once.

The linear layers and the vocabulary layers also take a `QuantizedWeight` (`workers/quantization/`) for their weight:
they slice it with its own `rows`/`cols`, fuse q/k/v (gate/up) parts with `fuse_rows` once all have arrived, and put
it in place of the dense parameter, which is dropped before it was ever written (so never resident). A fused layer
whose parts come some quantized and some dense dequantizes the quantized ones into its dense parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tokenmill.workers.backends import layer_ops
from tokenmill.workers.collectives import all_reduce
from tokenmill.workers.host_memory import gather_gguf_weights
from tokenmill.workers.models import rope as _rope
from tokenmill.workers.models.packed_linear import PackableLinear, can_pack, linear, packed
from tokenmill.workers.quantization.base import QuantizedWeight, fuse_rows


class LoRADelta(Protocol):
    """A linear layer's LoRA updates (`workers/lora/slots.py`): adds every token's adapter delta to the layer's
    output, in place, before its bias and before a row-parallel all-reduce (the deltas of the ranks' input columns
    are partial sums like the base matmul's)."""

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None: ...


class OutputSlice(NamedTuple):
    """One checkpoint tensor's rows inside a fused column-parallel weight (q, k, v; gate, up) on this rank."""

    shard_id: str
    dest_row: int  # first row in this rank's fused weight
    src_row: int  # first row taken from the full checkpoint tensor
    rows: int


class HeadShard(NamedTuple):
    """The attention heads one rank holds: query heads [first_head, first_head + num_heads), and likewise KV heads."""

    first_head: int
    num_heads: int
    first_kv_head: int
    num_kv_heads: int


class TensorParallel(NamedTuple):
    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None  # the torch.distributed group of this stage's ranks (None: the whole world)

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, MLP columns), which must divide evenly."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size

    def attention_heads(self, total_heads: int, total_kv_heads: int) -> HeadShard:
        """This rank's heads: whole KV heads, each with the query heads that share it.

        KV heads go to the ranks in contiguous runs as even as they can be (3 KV heads on 2 ranks: 2 and 1, which is
        how SmolLM2-135M's 9 query / 3 KV heads run on 2 ranks). With fewer KV heads than ranks, each KV head is
        replicated on size / total_kv_heads ranks and the query heads are split evenly.
        """
        if total_heads % total_kv_heads:
            raise ValueError(
                f"num_attention_heads={total_heads} is not a multiple of num_key_value_heads={total_kv_heads}"
            )
        group = total_heads // total_kv_heads
        if total_kv_heads >= self.size:
            base, extra = divmod(total_kv_heads, self.size)
            num_kv_heads = base + (1 if self.rank < extra else 0)
            first_kv_head = self.rank * base + min(self.rank, extra)
            return HeadShard(first_kv_head * group, num_kv_heads * group, first_kv_head, num_kv_heads)
        if self.size % total_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={self.size} is neither at most nor a multiple of "
                f"num_key_value_heads={total_kv_heads}"
            )
        num_heads = self.split(total_heads, "num_attention_heads")
        first_head = self.rank * num_heads
        return HeadShard(first_head, num_heads, first_head // group, 1)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.size > 1:  # workers/collectives.py: at once, or a captured decode graph's segment boundary
            all_reduce(partial, self.group)
        return partial

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """(first row, rows per rank, rows that are real) of this rank's slice of a vocabulary.

        Every rank holds ceil(vocab_size / size) rows so the shards gather into one tensor; the last rank's slice
        may run past the vocabulary, and those padding rows are zero.
        """
        rows_per_rank = -(-vocab_size // self.size)
        first_row = self.rank * rows_per_rank
        return first_row, rows_per_rank, max(0, min(rows_per_rank, vocab_size - first_row))


def copy_checked(dest: torch.Tensor, src: torch.Tensor, what: str) -> int:
    """Copy `src` into `dest` (converting dtype/device); shapes must match exactly, never broadcast."""
    if isinstance(src, QuantizedWeight):
        raise ValueError(
            f"{what}: this layer cannot hold {src.format} quantized weights; run the model with "
            f"--quantization none to dequantize them at load"
        )
    if dest.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match parameter {tuple(dest.shape)}")
    dest.copy_(src)
    return dest.numel()


def new_parameter(*shape: int) -> nn.Parameter:
    """An uninitialised inference parameter on the current default device and dtype (loading fills it)."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def set_weight(module: nn.Module, weight: nn.Module | nn.Parameter) -> None:
    """Put a quantized weight (a module) where a layer's dense `weight` parameter was, or a parameter back."""
    dense = module._parameters.pop("weight", None)
    module._modules.pop("weight", None)
    if dense is not None and isinstance(weight, nn.Module):
        weight = weight.to(dense.device)  # checkpoint readers build quantized weights on the CPU
    module.weight = weight


class FusedRowsLoad:
    """Mixin for column-parallel layers whose weight fuses several checkpoint tensors (`SHARDS`, in row order).

    Quantized parts wait until every shard has come, then become one `QuantizedWeight` (`fuse_rows`) in place of
    the dense parameter; dense parts are copied into it (quantized parts then dequantized beside them).
    """

    SHARDS: tuple[str, ...] = ()

    def load_rows(self, param_name: str, full, shard_id: str, dest_row: int, src_row: int, rows: int) -> int:
        what = f"{type(self).__name__}.{param_name}[{shard_id}]"
        pending = self.__dict__.setdefault("_quantized_parts", {})  # shard id -> (dest row, part)
        if param_name == "weight" and isinstance(full, QuantizedWeight):
            if full.in_features != self.weight.shape[1]:
                raise ValueError(
                    f"{what}: checkpoint shape {tuple(full.shape)} does not match parameter {tuple(self.weight.shape)}"
                )
            part = full.rows(src_row, rows)
            if self.__dict__.get("_dense_rows"):
                return copy_checked(
                    self.weight.data.narrow(0, dest_row, rows), part.dequantize(self.weight.dtype), what
                )
            pending[shard_id] = (dest_row, part)
            if len(pending) == len(self.SHARDS):
                set_weight(self, fuse_rows([pending[shard][1] for shard in self.SHARDS]))
                pending.clear()
            return part.numel()
        if param_name == "weight":
            self._dense_rows = True
            for shard, (row, part) in list(pending.items()):
                copy_checked(
                    self.weight.data.narrow(0, row, part.out_features),
                    part.dequantize(self.weight.dtype),
                    f"{type(self).__name__}.weight[{shard}]",
                )
            pending.clear()
        dest = getattr(self, param_name).data.narrow(0, dest_row, rows)
        return copy_checked(dest, full.narrow(0, src_row, rows), what)


class ReplicatedLoad:
    """Mixin: every rank holds the whole parameter."""

    def load(self, param_name: str, full: torch.Tensor, shard_id: str | None = None) -> int:
        return copy_checked(getattr(self, param_name).data, full, f"{type(self).__name__}.{param_name}")


class RMSNorm(ReplicatedLoad, nn.Module):
    """Root-mean-square norm, computed in float32 as Hugging Face does; optionally fuses the residual add.

    `unit_offset=True` is Gemma's variant: it scales by (1 + weight), in float32 before the cast back
    (transformers' `Gemma3RMSNorm`), and always runs the torch code (the fused kernels compute Llama's order).
    """

    def __init__(self, size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = new_parameter(size)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x_float * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x_float.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); with no residual, x itself is the new residual."""
        kernel = None if self.unit_offset else layer_ops(x.device.type).rms_norm
        if kernel is not None:
            return kernel(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        return self.normalize(x), x


class QKVLinear(FusedRowsLoad, nn.Module):
    """q_proj, k_proj and v_proj fused into one matmul; rows hold this rank's query heads, then its K and V heads."""

    SHARDS = ("q", "k", "v")

    def __init__(
        self, hidden_size: int, head_dim: int, total_heads: int, total_kv_heads: int, bias: bool, tp: TensorParallel
    ):
        super().__init__()
        self.head_dim = head_dim
        self.heads = tp.attention_heads(total_heads, total_kv_heads)
        self.num_heads = self.heads.num_heads
        self.num_kv_heads = self.heads.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # shard id -> (first row in the fused parameter, first row in the checkpoint tensor, rows)
        first_kv_row = self.heads.first_kv_head * head_dim
        self._shards = {
            "q": (0, self.heads.first_head * head_dim, self.q_size),
            "k": (self.q_size, first_kv_row, self.kv_size),
            "v": (self.q_size + self.kv_size, first_kv_row, self.kv_size),
        }
        self.weight = new_parameter(self.q_size + 2 * self.kv_size, hidden_size)
        self.bias = new_parameter(self.q_size + 2 * self.kv_size) if bias else None
        self.lora: LoRADelta | None = None

    def output_slices(self) -> list[OutputSlice]:
        return [OutputSlice(shard, *self._shards[shard]) for shard in self.SHARDS]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (views of one matmul output)."""
        qkv = linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = x.shape[0]
        return (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        )

    def load(self, param_name: str, full: torch.Tensor, shard_id: str | None = None) -> int:
        dest_row, src_row, rows = self._shards[shard_id]
        return self.load_rows(param_name, full, shard_id, dest_row, src_row, rows)


class GateUpLinear(FusedRowsLoad, nn.Module):
    """gate_proj and up_proj fused into one matmul, followed by SiLU(gate) * up."""

    SHARDS = ("gate", "up")

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.rank_size = tp.split(intermediate_size, "intermediate_size")
        self._first_src_row = tp.rank * self.rank_size
        self.weight = new_parameter(2 * self.rank_size, hidden_size)
        self.bias = new_parameter(2 * self.rank_size) if bias else None
        self.lora: LoRADelta | None = None

    def output_slices(self) -> list[OutputSlice]:
        return [
            OutputSlice("gate", 0, self._first_src_row, self.rank_size),
            OutputSlice("up", self.rank_size, self._first_src_row, self.rank_size),
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, gate_up)
        kernel = layer_ops(x.device.type).silu_and_mul
        if kernel is not None:
            return kernel(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def load(self, param_name: str, full: torch.Tensor, shard_id: str | None = None) -> int:
        dest_row = 0 if shard_id == "gate" else self.rank_size
        return self.load_rows(param_name, full, shard_id, dest_row, self._first_src_row, self.rank_size)


class RowParallelLinear(nn.Module):
    """A linear layer whose input columns are split across ranks; partial outputs are summed by an all-reduce.

    The split is even unless `input_columns` (first column, count) gives this rank's columns, as o_proj does to
    follow its rank's attention heads.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TensorParallel,
        input_columns: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.tp = tp
        if input_columns is None:
            rank_input_size = tp.split(input_size, "row-parallel input size")
            input_columns = (tp.rank * rank_input_size, rank_input_size)
        self.first_input_column, self.rank_input_size = input_columns
        self.weight = new_parameter(output_size, self.rank_input_size)
        self.bias = new_parameter(output_size) if bias else None
        self.lora: LoRADelta | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.weight)
        if self.lora is not None:
            self.lora.add_to(x, partial)  # this rank's input columns: summed by the all-reduce like the base
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias  # the bias is added once, after the sum

    def load(self, param_name: str, full: torch.Tensor, shard_id: str | None = None) -> int:
        if param_name == "bias":
            return copy_checked(self.bias.data, full, "row-parallel bias")
        if isinstance(full, QuantizedWeight):
            if full.out_features != self.weight.shape[0]:
                raise ValueError(
                    f"row-parallel weight: checkpoint shape {tuple(full.shape)} does not match "
                    f"{self.weight.shape[0]} output rows"
                )
            try:
                set_weight(self, full.cols(self.first_input_column, self.rank_input_size))
            except (ValueError, NotImplementedError) as exc:
                raise ValueError(
                    f"row-parallel weight: cannot take this rank's input columns [{self.first_input_column}"
                    f", {self.first_input_column + self.rank_input_size}) of a {full.format} weight for "
                    f"tensor parallelism ({exc})"
                ) from None
            return self.weight.numel()
        columns = full.narrow(1, self.first_input_column, self.rank_input_size)
        return copy_checked(self.weight.data, columns, "row-parallel weight")


class VocabEmbedding(nn.Module):
    """Token embedding table, vocab-parallel: each rank looks up the ids in its slice, zeros the others, all-reduces.

    A quantized table stays quantized when its format can dequantize just the looked-up rows (a `lookup(ids, dtype)`
    method, as `GGUFWeight` has); otherwise it is dequantized into the dense table at load.
    """

    NEEDS_LOOKUP = True  # the LM head only multiplies by its table

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel = TensorParallel(),
        weight: nn.Parameter | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.first_row, self.rows_per_rank, self.num_real_rows = tp.vocab_rows(vocab_size)
        self.weight = weight if weight is not None else new_parameter(self.rows_per_rank, hidden_size)
        self.dtype = self.weight.dtype  # the activation dtype, kept for a quantized table's lookups

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return self.weight.lookup(ids, self.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._embed(input_ids)
        local_ids = input_ids - self.first_row
        owned = (local_ids >= 0) & (local_ids < self.num_real_rows)
        embedded = self._embed(local_ids.masked_fill(~owned, 0))
        return self.tp.all_reduce(embedded.masked_fill_(~owned[:, None], 0))

    def load(self, param_name: str, full: torch.Tensor, shard_id: str | None = None) -> int:
        """Copy this rank's rows of the `[vocab, hidden]` checkpoint tensor and zero the padding rows."""
        what = f"{type(self).__name__}.{param_name}"
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"{what}: checkpoint has {full.shape[0]} rows for a vocabulary of {self.vocab_size}")
        if isinstance(full, QuantizedWeight):
            if full.in_features != self.weight.shape[1]:
                raise ValueError(
                    f"{what}: checkpoint shape {tuple(full.shape)} does not match parameter {tuple(self.weight.shape)}"
                )
            rows = full.rows(self.first_row, self.num_real_rows)
            if not self.NEEDS_LOOKUP or hasattr(rows, "lookup"):
                set_weight(self, rows)  # the padding rows past the vocabulary are not stored (LMHead pads the logits)
                return self.rows_per_rank * full.in_features
            src = rows.dequantize(self.dtype)
        else:
            src = full.narrow(0, self.first_row, self.num_real_rows)
        dest = self.weight.data
        written = copy_checked(dest[: self.num_real_rows], src, what)
        dest[self.num_real_rows :].zero_()
        return written + dest[self.num_real_rows :].numel()


class LMHead(VocabEmbedding):
    """Hidden states -> float32 logits over the whole vocabulary, on every rank.

    Vocab-parallel like the embedding, whose weight it may share: each rank computes its slice's logits and an
    all-gather joins the slices (every rank takes part; only rank 0 samples).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel = TensorParallel(),
        tied_to: VocabEmbedding | None = None,
    ):
        super().__init__(vocab_size, hidden_size, tp, weight=tied_to.weight if tied_to is not None else None)
        self.tied = tied_to is not None
        self._tied_to = (tied_to,)  # in a tuple: not registered as a submodule
        self.packed_tied_weight: nn.Parameter | None = None  # a oneDNN copy of a tied weight (`pack_linear_weights`)

    NEEDS_LOOKUP = False

    def follow_tied_embedding(self) -> None:
        """Share the embedding's weight again after loading replaced it (with a quantized one)."""
        if self.tied and self.weight is not self._tied_to[0].weight:
            set_weight(self, self._tied_to[0].weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.packed_tied_weight if self.packed_tied_weight is not None else self.weight)
        if logits.shape[-1] < self.rows_per_rank:  # a quantized shard stores no padding rows
            logits = F.pad(logits, (0, self.rows_per_rank - logits.shape[-1]))
        if self.tp.size > 1:
            shards = [torch.empty_like(logits) for _ in range(self.tp.size)]
            dist.all_gather(shards, logits, group=self.tp.group)
            logits = torch.cat(shards, dim=-1)[:, : self.vocab_size].contiguous()  # drops the padding rows' logits
        return logits.float()


def pack_linear_weights(model: nn.Module) -> None:
    """Reorder every matmul weight of `model` for oneDNN where it runs on CPU (`packed_linear`).

    Call it once the weights are loaded: a packed weight can no longer be loaded into or read. A tied LM head gets a
    packed copy and leaves the shared weight dense for the embedding's lookups, as vLLM's CPU backend does. Quantized
    weights repack themselves where their format has a faster layout (`QuantizedWeight.pack_for_matmul`); GGUF
    weights then move onto huge pages together (`host_memory.gather_gguf_weights`).
    """
    for module in model.modules():
        if isinstance(module, QuantizedWeight):  # a quantized weight runs its own kernel, maybe on a layout of its own
            module.pack_for_matmul()
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight) or not can_pack(weight):
            continue
        if isinstance(module, LMHead) and module.tied:
            module.packed_tied_weight = packed(module.weight)
        elif isinstance(module, (QKVLinear, GateUpLinear, RowParallelLinear, LMHead, PackableLinear)):
            module.weight = packed(module.weight)
    gather_gguf_weights(model)  # the GGUF weights, repacked, into one region on huge pages (workers/host_memory.py)


# ---------------------------------------------------------------- rotary position embeddings


def rope_inverse_frequencies(head_dim: int, params: dict, max_position_embeddings: int) -> torch.Tensor:
    """float32 `[rot_dim / 2]` inverse frequencies of any supported rope type (`workers/models/rope.py`)."""
    return _rope.inverse_frequencies(head_dim, params, max_position_embeddings)[0]


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding over the first `rot_dim` dims of each head (partial rotary leaves
    the rest as they are). `for_step` runs once per step; every layer reuses its result.

    Every rope type is a table lookup (`workers/models/rope.py` computes the table as transformers does, attention
    factor included); `max_model_len` sizes the table (default max_position_embeddings) and fixes LongRoPE's factor.
    """

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int, max_model_len: int | None = None):
        super().__init__()
        inv_freq, self.attention_factor = _rope.inverse_frequencies(
            head_dim, params, max_position_embeddings, max_model_len
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.params = params
        self.head_dim = head_dim
        self.rot_dim = 2 * inv_freq.numel()
        self.max_position_embeddings = max_position_embeddings
        self.max_model_len = max_model_len
        self.num_positions = max_model_len or max_position_embeddings
        self._cos_sin_table: torch.Tensor | None = None

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        """The rotation of one step's positions: cos/sin for the torch code, or the kernel's table lookup."""
        kernel = layer_ops(positions.device.type).rotary
        if kernel is None:
            cos, sin = self.cos_sin(positions, dtype)
            return RotaryStep(cos=cos, sin=sin)
        return RotaryStep(positions=positions, cos_sin_table=self.cos_sin_table(), kernel=kernel)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, rot_dim / 2]` for the positions: float32 table rows cast like Hugging Face does."""
        cos, sin = self.cos_sin_table()[positions.long()].chunk(2, dim=-1)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def cos_sin_table(self) -> torch.Tensor:
        """float32 `[num_positions, rot_dim]` (cos half, then sin half) for the rotary kernel; built once.

        It is first needed by the start-up profiling step, before any CUDA graph is captured.
        """
        if self._cos_sin_table is None:
            table = _rope.rope_table(
                self.head_dim, self.params, self.max_position_embeddings, self.num_positions, self.max_model_len
            )
            self._cos_sin_table = table.to(self.inv_freq.device)
        return self._cos_sin_table


@dataclass
class RotaryStep:
    """One step's rotation, shared by every layer: torch cos/sin, or positions + table for a fused kernel."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    cos_sin_table: torch.Tensor | None = None
    kernel: Callable | None = None

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]` and k `[T, Hkv, D]` rotated by their positions (the kernel rotates them in place)."""
        if self.kernel is not None:
            return self.kernel(q, k, self.positions, self.cos_sin_table)
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rot_dim dims of x `[T, heads, head_dim]` by the angles whose cos/sin are
    `[T, 1, rot_dim / 2]`."""
    rot_dim = 2 * cos.shape[-1]
    x_rot, x_pass = (x, None) if rot_dim == x.shape[-1] else (x[..., :rot_dim], x[..., rot_dim:])
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated if x_pass is None else torch.cat((rotated, x_pass), dim=-1)
