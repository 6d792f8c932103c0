"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) as embedding models: packed batch in, last hidden states out.

A step's sequences arrive packed into one flat batch of T tokens (`query_start_loc` marks where each starts), as
for the decoders, but attention is bidirectional and stays within each sequence. There is no KV cache: an
embedding request is encoded in one step and pooled (see `workers/pooling.py`).

    forward(input_ids[T], positions[T], query_start_loc[B + 1]) -> last_hidden_state[T, H]
    load_weights(iterable of (hf_name, tensor))   names with or without a "bert." / "roberta." prefix

Parameter names follow the HF checkpoints (`embeddings.word_embeddings`, `encoder.layer.N.attention.self.query`, ...)
except that query/key/value are fused into one matmul (`attention.self.qkv`) at load time. Every token's
token_type_id is 0 unless the caller passes them (a cross-encoder's text pair, `bert_classifier.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.workers.models.packed_linear import PackableLinear

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU, what BERT checkpoints call "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

# Checkpoint prefixes in front of the encoder's own names (task heads keep the encoder under one of these).
_MODEL_PREFIXES = ("bert.", "roberta.")
# Checkpoint tensors an embedding model does not use: the pooler and task heads, and a non-parameter buffer.
_UNUSED_PREFIXES = ("pooler.", "cls.", "lm_head.", "classifier.", "qa_outputs.")
_UNUSED_NAMES = ("embeddings.position_ids",)
_QKV_SHARDS = {"query": 0, "key": 1, "value": 2}


@dataclass
class PackedAttentionLayout:
    """How one step's packed sequences are laid out for a single SDPA call per layer; built once per forward.

    Two layouts compute the same thing and the cheaper one is chosen:
    - `padded`: tokens gathered into [B, max_len] with a key-padding mask; costs B * max_len^2.
    - block-diagonal: the flat batch as one sequence with a [T, T] same-sequence mask; costs T^2, which wins
      when one long sequence shares the step with many short ones.
    With one sequence neither mask is needed.
    """

    mask: torch.Tensor | None  # bool, True where a query may attend a key: [B, 1, 1, max_len] or [1, 1, T, T]
    gather_index: torch.Tensor | None  # [B * max_len] int64 token row per padded slot (padded layout only)
    valid_slots: torch.Tensor | None  # [T] int64 padded slots holding real tokens, in token order (padded only)
    num_sequences: int
    max_len: int

    @classmethod
    def build(cls, query_start_loc: torch.Tensor, num_tokens: int, padded: bool | None = None) -> PackedAttentionLayout:
        """`padded` forces a layout (tests); None picks the cheaper one."""
        starts = query_start_loc.to(torch.int64)
        lengths = starts[1:] - starts[:-1]
        num_sequences = lengths.numel()
        if num_sequences == 1:
            return cls(None, None, None, 1, num_tokens)
        max_len = int(lengths.max())  # one host sync per step, needed to size the padded batch
        if padded is None:
            padded = num_sequences * max_len * max_len <= num_tokens * num_tokens
        if not padded:
            sequence_of_token = torch.repeat_interleave(
                torch.arange(num_sequences, device=starts.device), lengths, output_size=num_tokens
            )
            mask = sequence_of_token[:, None] == sequence_of_token[None, :]
            return cls(mask[None, None], None, None, num_sequences, max_len)
        offsets = torch.arange(max_len, device=starts.device)
        is_token = offsets[None, :] < lengths[:, None]  # [B, max_len]
        # padding slots read token 0; their outputs are dropped and no real query attends them
        gather_index = torch.where(is_token, starts[:-1, None] + offsets[None, :], 0).reshape(-1)
        valid_slots = is_token.reshape(-1).nonzero().squeeze(1)
        return cls(is_token[:, None, None, :], gather_index, valid_slots, num_sequences, max_len)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k, v [T, heads, head_dim] -> [T, heads * head_dim], attending only within each sequence."""
        num_tokens, num_heads, head_dim = q.shape
        if self.gather_index is None:  # one sequence, or the block-diagonal layout: [1, heads, T, head_dim]
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale)
            return out.squeeze(0).transpose(0, 1).reshape(num_tokens, num_heads * head_dim)
        shape = (self.num_sequences, self.max_len, num_heads, head_dim)
        q, k, v = (x.index_select(0, self.gather_index).view(shape).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale)  # [B, heads, L, D]
        out = out.transpose(1, 2).reshape(self.num_sequences * self.max_len, num_heads * head_dim)
        return out.index_select(0, self.valid_slots)


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        # RoBERTa numbers positions from padding_idx + 1; BERT from 0
        is_roberta = getattr(config, "model_type", "bert") in ("roberta", "xlm-roberta")
        self.position_offset = (config.pad_token_id + 1) if is_roberta else 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:  # every token of type 0: one row, broadcast
            return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])
        return self.LayerNorm(hidden + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.qkv = PackableLinear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, hidden: torch.Tensor, layout: PackedAttentionLayout) -> torch.Tensor:
        q, k, v = self.qkv(hidden).view(hidden.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return layout.attend(q, k, v, self.scale)

    def load_shard(self, projection: str, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The slice of the fused qkv parameter that checkpoint tensor `<projection>.<param_name>` fills."""
        rows = self.qkv.out_features // 3
        return getattr(self.qkv, param_name).data.narrow(0, _QKV_SHARDS[projection] * rows, rows)


class BertDenseAddNorm(nn.Module):
    """dense -> + residual -> LayerNorm (post-LN); HF calls these `attention.output` and `output`."""

    def __init__(self, in_features: int, hidden_size: int, eps: float):
        super().__init__()
        self.dense = PackableLinear(in_features, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseAddNorm(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, layout: PackedAttentionLayout) -> torch.Tensor:
        return self.output(self.self(hidden, layout), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported")
        self.dense = PackableLinear(config.hidden_size, config.intermediate_size)
        self.activation = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseAddNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, layout: PackedAttentionLayout) -> torch.Tensor:
        hidden = self.attention(hidden, layout)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertEmbeddingModel(nn.Module):
    """A BertModel (or RoBERTa) without its pooler: token embeddings in, last hidden states out."""

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device):
        super().__init__()
        position_type = getattr(hf_config, "position_embedding_type", "absolute") or "absolute"
        if position_type != "absolute":
            raise NotImplementedError(f"position_embedding_type {position_type!r} is not supported")
        if getattr(hf_config, "is_decoder", False):
            raise NotImplementedError("BERT configured as a decoder (is_decoder=True) is not an embedding model")
        self.config = hf_config
        with torch.device("meta"):  # no random init: load_weights fills every parameter
            self.embeddings = BertEmbeddings(hf_config)
            self.encoder = BertEncoder(hf_config)
        self.to(dtype)
        self.to_empty(device=device)
        self.requires_grad_(False)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        padded_layout: bool | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed batch -> last_hidden_state [T, H]. `padded_layout` forces an attention layout (tests only);
        `token_type_ids` [T] are a text pair's segments (None: all 0)."""
        layout = PackedAttentionLayout.build(query_start_loc, input_ids.shape[0], padded_layout)
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, layout)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the parameters; fail if any is unknown or left unfilled."""
        params = dict(self.named_parameters())
        filled = dict.fromkeys(params, 0)
        for name, tensor in weights:
            name = strip_model_prefix(name)
            if name.startswith(_UNUSED_PREFIXES) or name in _UNUSED_NAMES:
                continue
            module_path, _, param_name = name.rpartition(".")
            parent_path, _, projection = module_path.rpartition(".")
            if projection in _QKV_SHARDS:
                target = f"{parent_path}.qkv.{param_name}"
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
                dest = self.get_submodule(parent_path).load_shard(projection, param_name, tensor)
            else:
                target = name
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
                dest = params[target].data
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled[target] += dest.numel()
        wrong = [name for name, count in filled.items() if count != params[name].numel()]
        if wrong:
            raise ValueError(f"parameters not filled exactly once by the checkpoint: {wrong[:8]}")


def strip_model_prefix(name: str) -> str:
    for prefix in _MODEL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name
