"""The Llama-family decoder: one implementation for Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k norm).

Built from a Hugging Face config; parameter names follow the HF checkpoints (`model.layers.N.self_attn...`) except
that q/k/v and gate/up are fused into single matmuls at load time (`qkv_proj`, `gate_up_proj`).

    forward(input_ids[T], positions[T], attn, kv_caches) -> hidden[T, H]   (after the final norm)
    forward(..., intermediate=(hidden, residual)) on a later pipeline stage; a stage before the last returns
        its (hidden, residual) for the next one (workers/models/pipeline.py)
    compute_logits(hidden[N, H]) -> float32 logits[N, V]
    load_weights(iterable of (hf_name, tensor))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from tokenmill.kernels.kv_quant import kv_scale_target, scale_value
from tokenmill.workers.attention import AttentionLayer, AttentionMetadata, paged_attention
from tokenmill.workers.models.layers import (
    GateUpLinear,
    LMHead,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RotaryStep,
    RowParallelLinear,
    TensorParallel,
    VocabEmbedding,
    copy_checked,
)
from tokenmill.workers.models.pipeline import MissingLayer, PipelineStage
from tokenmill.workers.models.rope import rope_parameters

KVCache = tuple[torch.Tensor, torch.Tensor]

# HF projection name -> (fused module name, shard id)
_FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class DecoderAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, tp: TensorParallel):
        super().__init__()
        hidden_size = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or hidden_size // config.num_attention_heads
        out_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(
            hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads, qkv_bias, tp
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        # the sliding window is set by the model (layer_sliding_windows), the fp8 KV scales by the checkpoint if any
        self.attn_layer = AttentionLayer(scale=head_dim**-0.5)
        rank_columns = (self.qkv_proj.heads.first_head * head_dim, self.num_heads * head_dim)  # this rank's heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden_size, out_bias, tp, rank_columns)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryStep,
        kv_cache: KVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden)
        if self.q_norm is not None:
            q = self.q_norm.normalize(q)
            k = self.k_norm.normalize(k)
        q, k = rotary.rotate(q, k)
        out = paged_attention(q, k, v, kv_cache, self.attn_layer, attn)
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))


# Tokens per pass through a CPU MLP. A 1,024-token prompt's gate/up output of a 0.5B model (4,864 * 2 wide) is 40 MB of
# float32, above glibc's largest mmap threshold (32 MB): each layer mapped fresh pages for it and faulted every one
# in (~14 ms a layer, ~10% of the prefill). 256 tokens keep it under the threshold, so the heap reuses it, and it
# stays in the last-level cache for SiLU-and-mul and the down projection. A token's rows are the same bits either
# way (the GGUF kernels are batch-invariant and group tokens by 4 or 8 from a pass's first; the dense matmuls are
# per row).
CPU_MLP_TOKEN_CHUNK = 256


class DecoderMLP(nn.Module):
    def __init__(self, config, tp: TensorParallel):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size, bias, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= CPU_MLP_TOKEN_CHUNK or not self._chunks_tokens(x):
            return self.down_proj(self.gate_up_proj(x))
        chunks = x.split(CPU_MLP_TOKEN_CHUNK)
        return torch.cat([self.down_proj(self.gate_up_proj(chunk)) for chunk in chunks])

    def _chunks_tokens(self, x: torch.Tensor) -> bool:
        """On the CPU alone, one rank (no all-reduce per chunk), no LoRA (its deltas index the step's tokens)."""
        return (
            x.device.type == "cpu"
            and x.dim() == 2
            and self.down_proj.tp.size == 1
            and self.gate_up_proj.lora is None
            and self.down_proj.lora is None
        )


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, tp: TensorParallel, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, qkv_bias, qk_norm, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else DecoderMLP(config, tp)  # a model may swap in its own (MoE)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryStep,
        kv_cache: KVCache,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, kv_cache, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        config,
        qkv_bias: bool,
        qk_norm: bool,
        tp: TensorParallel,
        make_mlp=None,
        pp: PipelineStage = PipelineStage(),
        max_model_len: int | None = None,
    ):
        super().__init__()
        self.pp = pp
        self.start_layer, self.end_layer = pp.layer_range(config.num_hidden_layers)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp) if pp.is_first else MissingLayer()
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, qk_norm, tp, make_mlp(index) if make_mlp else None)
            if self.start_layer <= index < self.end_layer
            else MissingLayer()
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else MissingLayer()
        head_dim = self.layers[self.start_layer].self_attn.head_dim
        self.rotary = RotaryEmbedding(head_dim, rope_parameters(config), config.max_position_embeddings, max_model_len)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: Sequence[KVCache],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states; on a stage before the last, (hidden, residual) for the next stage."""
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        rotary = self.rotary.for_step(positions, hidden.dtype)  # once per step, shared by all layers
        for layer, kv_cache in zip(self.layers[self.start_layer : self.end_layer], kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rotary, kv_cache, attn)
        if not self.pp.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class PagedCausalLM(nn.Module):
    """What the model runner needs of a decoder: `self.model` (layers whose `self_attn` has `num_kv_heads` and
    `head_dim`) run over the paged KV caches, and `self.lm_head`. Subclasses build both, then call `_adopt_layers`."""

    kv_sliding_window: int | None = None  # what the scheduler may free blocks by (every layer windowed), else None
    supports_pipeline_parallel = False  # True where the constructor takes `pp` (a PipelineStage)
    pp = PipelineStage()

    def _adopt_layers(self) -> None:
        layers = [layer for layer in self.model.layers if not isinstance(layer, MissingLayer)]  # this stage's
        attention = layers[0].self_attn
        self.num_layers = len(layers)
        self.num_kv_heads = attention.num_kv_heads  # per rank
        self.head_dim = attention.head_dim

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of this stage's layers (the attention metadata precomputes their reads)."""
        windows = {
            layer.self_attn.attn_layer.sliding_window
            for layer in self.model.layers
            if not isinstance(layer, MissingLayer)
        }
        return tuple(sorted(window for window in windows if window is not None))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) cache."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: Sequence[KVCache],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if intermediate is None:
            return self.model(input_ids, positions, attn, kv_caches)  # models without pipeline stages
        return self.model(input_ids, positions, attn, kv_caches, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class LlamaForCausalLM(PagedCausalLM):
    """Llama and its close relatives; subclasses only flip the two architectural switches below."""

    QKV_BIAS: bool | None = None  # None: follow config.attention_bias
    QK_NORM = False
    supports_pipeline_parallel = True

    def __init__(
        self,
        config,
        tp: TensorParallel = TensorParallel(),
        pp: PipelineStage = PipelineStage(),
        max_model_len: int | None = None,
    ):
        """`max_model_len`: the engine's context length (the rotary table's, and LongRoPE's short/long choice);
        None: the checkpoint's max_position_embeddings."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.pp = pp
        qkv_bias = self.QKV_BIAS if self.QKV_BIAS is not None else bool(getattr(config, "attention_bias", False))
        self.model = DecoderModel(
            config, qkv_bias, self.QK_NORM, tp, lambda index: self.make_mlp(index), pp, max_model_len
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # a last stage without the embedding holds its own copy of a tied head (PipelineStage.weight_name)
        tied_to = self.model.embed_tokens if self.tie_word_embeddings and pp.is_first else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp, tied_to=tied_to) if pp.is_last else None
        self._adopt_layers()
        windows = layer_sliding_windows(config)
        for layer, window in zip(self.model.layers, windows, strict=True):
            if not isinstance(layer, MissingLayer):
                layer.self_attn.attn_layer = dataclasses.replace(layer.self_attn.attn_layer, sliding_window=window)
        # what the scheduler may free by: the largest window when every layer has one, else None
        self.kv_sliding_window = max(windows) if windows and None not in windows else None

    def make_mlp(self, layer_index: int) -> nn.Module | None:
        """The MLP of layer `layer_index`; None for the dense `DecoderMLP` (MoE models override this)."""
        return None

    def weight_target(self, name: str) -> tuple[str, str, object]:
        """(module path, parameter name, shard id) that the checkpoint tensor `name` loads into."""
        return fused_projection_target(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_hf_weights(self, weights, self.weight_target)


def fused_projection_target(name: str) -> tuple[str, str, object]:
    """(module path, parameter name, shard id) of an HF tensor name: q/k/v and gate/up go into their fused modules."""
    module_path, _, param_name = name.rpartition(".")
    parent_path, _, module_name = module_path.rpartition(".")
    shard_id = None
    if module_name in _FUSED_PROJECTIONS:
        module_name, shard_id = _FUSED_PROJECTIONS[module_name]
        module_path = f"{parent_path}.{module_name}"
    return module_path, param_name, shard_id


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    weight_target: Callable[[str], tuple[str, str, object]],
) -> None:
    """Copy HF-named checkpoint tensors into the model's (fused, per-rank) parameters, each where `weight_target`
    says; fail unless every parameter is filled exactly once."""
    params = dict(model.named_parameters())  # a tied lm_head.weight appears once, as the embedding
    filled = dict.fromkeys(params, 0)
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (model.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if model.pp.size > 1:
            name = model.pp.weight_name(name, model.config.num_hidden_layers, model.tie_word_embeddings)
            if name is None:  # another pipeline stage's
                continue
        kv_scale = kv_scale_target(name)
        if kv_scale is not None:  # a float attribute of the attention (used by an fp8 KV cache), not a parameter
            attention_path, attributes = kv_scale
            attention = model.get_submodule(attention_path)
            value = scale_value(tensor, name)
            attention.attn_layer = dataclasses.replace(attention.attn_layer, **dict.fromkeys(attributes, value))
            continue
        module_path, param_name, shard_id = weight_target(name)
        target = f"{module_path}.{param_name}"
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        module = model.get_submodule(module_path)
        if hasattr(module, "load"):  # takes a QuantizedWeight for a linear weight; counts it as its numel()
            filled[target] += module.load(param_name, tensor, shard_id)
        else:
            filled[target] += copy_checked(params[target].data, tensor, name)
    wrong = [name for name, count in filled.items() if count != params[name].numel()]
    if wrong:
        raise ValueError(f"parameters not filled exactly once by the checkpoint: {wrong[:8]}")
    for module in model.modules():
        if isinstance(module, LMHead):
            module.follow_tied_embedding()  # the embedding's weight may have been replaced by a quantized one


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    QKV_BIAS = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    QK_NORM = True


def layer_sliding_windows(config) -> list[int | None]:
    """Each layer's sliding window as transformers applies it, None for a full-attention layer.

    `sliding_window` unset (or `use_sliding_window` false, Qwen2/Qwen3): none. Else `layer_types` decides where the
    config has it ("sliding_attention" layers; transformers derives it for Qwen2/Qwen3 from `max_window_layers`:
    layers from that index on slide), then `max_window_layers` alone, else every layer slides (Mistral).
    """
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is None or not getattr(config, "use_sliding_window", True):
        return [None] * num_layers
    window = int(window)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types[:num_layers]]
    max_window_layers = getattr(config, "max_window_layers", None)
    if max_window_layers is not None:
        return [window if i >= max_window_layers else None for i in range(num_layers)]
    return [window] * num_layers
