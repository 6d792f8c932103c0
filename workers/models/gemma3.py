"""Gemma 3 text decoders: `Gemma3ForCausalLM` (model_type gemma3_text) and the language model of
`Gemma3ForConditionalGeneration` (model_type gemma3: config in `config.text_config`, weights under `language_model`
prefixes; the vision tower and the multimodal projector are skipped at load). Computed as transformers does:

- layers alternate sliding-window (local) and global attention (`config.layer_types`, or the older
  `sliding_window_pattern`); each kind has its own RoPE (`rope_parameters["sliding_attention"]` /
  `["full_attention"]`, or the older `rope_local_base_freq` / `rope_theta` + `rope_scaling`);
- queries are scaled by `query_pre_attn_scalar ** -0.5`; q and k go through per-head RMS norms before RoPE;
- four (1 + w) RMSNorms per layer: input, post-attention, pre-feedforward, post-feedforward;
- GELU-tanh gated MLP; embeddings scaled by sqrt(hidden_size) in the model dtype; tied LM head; final logit
  softcapping when the config sets it.

Parameter names follow the HF checkpoints (`model.layers.N...`), with q/k/v and gate/up fused at load as in
`llama.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

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
)
from tokenmill.workers.models.llama import PagedCausalLM, fused_projection_target, load_hf_weights
from tokenmill.workers.models.packed_linear import linear
from tokenmill.workers.models.rope import rope_parameters

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]
SLIDING, FULL = "sliding_attention", "full_attention"

# Checkpoint prefixes of Gemma3ForConditionalGeneration: old hub layout and transformers 5's layout.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def layer_types(config) -> list[str]:
    """Each layer's attention kind, from `layer_types` or the older `sliding_window_pattern` (every Nth is global)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", None) or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


def gemma_rope_parameters(config, layer_type: str) -> dict:
    """The rope settings of one layer kind as `rope_parameters` spells them (`rope_type`, `rope_theta`, scaling)."""
    nested = getattr(config, "rope_parameters", None)
    if isinstance(nested, dict) and isinstance(nested.get(layer_type), dict):  # transformers 5: one dict per kind
        one_kind = SimpleNamespace(
            rope_parameters=dict(nested[layer_type]),
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
            partial_rotary_factor=getattr(config, "partial_rotary_factor", None),
        )
        return rope_parameters(one_kind)
    if layer_type == SLIDING:  # older configs: local layers use plain RoPE with their own base
        return {"rope_type": "default", "rope_theta": float(getattr(config, "rope_local_base_freq", 10000.0))}
    params = rope_parameters(config)
    if not hasattr(config, "rope_theta") and "rope_theta" not in (getattr(config, "rope_scaling", None) or {}):
        params["rope_theta"] = 1_000_000.0  # transformers' Gemma 3 default for global layers
    return params


class GeluTanhGateUpLinear(GateUpLinear):
    """The fused gate/up projection with GELU (tanh approximation) on the gate: gelu_tanh(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.weight, self.bias).chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_type: str, tp: TensorParallel):
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("attention logit softcapping is not supported by the attention backends")
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("bidirectional Gemma 3 attention (embedding models) is not supported")
        hidden_size = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or hidden_size // config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(
            hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads, bias, tp
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        rank_columns = (self.qkv_proj.heads.first_head * head_dim, self.num_heads * head_dim)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden_size, bias, tp, rank_columns)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, unit_offset=True)
        self.is_sliding = layer_type == SLIDING
        # the fp8 KV scales are set by the checkpoint, if it has them
        self.attn_layer = AttentionLayer(
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=config.sliding_window if self.is_sliding else None,
        )

    def forward(self, hidden: torch.Tensor, rotary: RotaryStep, kv_cache: KVCache, attn: AttentionMetadata):
        q, k, v = self.qkv_proj(hidden)
        q, k = rotary.rotate(self.q_norm.normalize(q), self.k_norm.normalize(k))
        out = paged_attention(q, k, v, kv_cache, self.attn_layer, attn)
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))


class Gemma3MLP(nn.Module):
    def __init__(self, config, tp: TensorParallel):
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise NotImplementedError(f"Gemma 3 MLP activation {activation!r} is not supported")
        self.gate_up_proj = GeluTanhGateUpLinear(config.hidden_size, config.intermediate_size, False, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str, tp: TensorParallel):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.self_attn = Gemma3Attention(config, layer_type, tp)
        self.post_attention_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.mlp = Gemma3MLP(config, tp)
        self.post_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryStep,
        kv_cache: KVCache,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in, (this layer's MLP output, the residual stream before it) out; the caller's next
        norm adds them, which is transformers' `residual + post_feedforward_layernorm(...)`."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm.normalize(self.self_attn(hidden, rotary, kv_cache, attn))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm.normalize(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config, tp: TensorParallel, max_model_len: int | None = None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layer_types = layer_types(config)
        if len(self.layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {config.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise NotImplementedError(f"Gemma 3 layer types {sorted(unknown)} are not supported")
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, kind, tp) for kind in self.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.embed_scale = float(config.hidden_size) ** 0.5
        head_dim = self.layers[0].self_attn.head_dim
        max_positions = config.max_position_embeddings
        self.rotary_local = RotaryEmbedding(
            head_dim, gemma_rope_parameters(config, SLIDING), max_positions, max_model_len
        )
        self.rotary_global = RotaryEmbedding(
            head_dim, gemma_rope_parameters(config, FULL), max_positions, max_model_len
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: Sequence[KVCache],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers keeps the scale as a float32 tensor and casts it to the weights' dtype before multiplying
        hidden = hidden * torch.tensor(self.embed_scale, dtype=torch.float32).to(hidden.dtype)
        rotary = {
            SLIDING: self.rotary_local.for_step(positions, hidden.dtype),
            FULL: self.rotary_global.for_step(positions, hidden.dtype),
        }
        residual = None
        for layer, kind, kv_cache in zip(self.layers, self.layer_types, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rotary[kind], kv_cache, attn)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(PagedCausalLM):
    """Gemma 3's text decoder; built from a gemma3_text config, or from a gemma3 config's `text_config`."""

    FINAL_LOGIT_SOFTCAPPING = True  # whether `config.final_logit_softcapping` applies (see the subclass)

    def __init__(self, config, tp: TensorParallel = TensorParallel(), max_model_len: int | None = None):
        """`max_model_len`: the engine's context length (the rotary tables'); None: max_position_embeddings."""
        super().__init__()
        text_config = getattr(config, "text_config", None) or config
        self.config = text_config
        self.tp = tp
        self.model = Gemma3Model(text_config, tp, max_model_len)
        self.tie_word_embeddings = bool(getattr(text_config, "tie_word_embeddings", True))
        tied_to = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(text_config.vocab_size, text_config.hidden_size, tp, tied_to=tied_to)
        self.final_logit_softcapping = getattr(text_config, "final_logit_softcapping", None)
        if not self.FINAL_LOGIT_SOFTCAPPING and self.final_logit_softcapping is not None:
            log.warning(
                "final_logit_softcapping=%s is ignored, as transformers' %s ignores it",
                self.final_logit_softcapping,
                type(self).__name__,
            )
            self.final_logit_softcapping = None
        self._adopt_layers()  # global layers keep every block: kv_sliding_window stays None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors in (text-only or multimodal layout; vision weights skipped), every parameter filled once."""
        load_hf_weights(self, _text_weights(weights), fused_projection_target)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint, served as text-only.

    transformers' Gemma3ForConditionalGeneration never softcaps its logits, even when `text_config` sets
    `final_logit_softcapping` (released Gemma 3 checkpoints set none), so neither does this.
    """

    FINAL_LOGIT_SOFTCAPPING = False


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        for prefix, replacement in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix) :]
                break
        yield name, tensor
