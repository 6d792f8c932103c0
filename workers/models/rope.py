"""Rotary position embedding tables for every rope type transformers' decoders use, computed as transformers does.

`rope_parameters(config)` reads a Hugging Face config into one flat dict (transformers 5's `rope_parameters`, or the
older `rope_theta` + `rope_scaling`, with `partial_rotary_factor` and `original_max_position_embeddings` moved in as
transformers' `standardize_rope_params` moves them). `RopeTable` turns it into what the model layers and the rotary
kernels use: a float32 `[num_positions, rot_dim]` table, cos half then sin half, of position * inverse frequency,
times the type's attention factor (YaRN's mscale, LongRoPE's scaling), where `rot_dim = int(head_dim *
partial_rotary_factor)` rounded down to even; dimensions past it pass through unrotated.

The inverse frequencies mirror `transformers.modeling_rope_utils` (5.x) operation by operation in float32; nothing
here imports transformers. Types: `default`, `linear`, `dynamic`, `yarn`, `longrope`, `llama3`; any other is refused
with one sentence naming it (`UnsupportedRopeType`), when the model is built.

Two types depend, in transformers, on the length of the forward pass that computes them (the `dynamic_rope_update`
decorator); a paged engine needs one rotation per position, whatever the batch or chunk, so that cached keys and
prefix-cache blocks stay valid. The choices, each exact against transformers' `generate` in the cases named:

- `dynamic` (dynamic NTK): row p is computed for seq_len = max(p + 1, max_position_embeddings). This is what
  `generate` does for a prompt that fits max_position_embeddings: the prompt's forward and every decode step inside
  it use the unscaled base, and each decode step past it recomputes the base for its own length (cached keys keep
  the rotation they were written with). A prompt longer than max_position_embeddings is rotated by transformers with
  the base of its whole length at every position; here each position keeps its own row (vLLM instead computes one
  base for the longest length).
- `longrope` (Phi-3, Phi-4-mini): the long factors for every position when the engine's max_model_len exceeds
  original_max_position_embeddings, else the short factors (as vLLM). transformers picks long when its forward's
  length exceeds original_max_position_embeddings, so this equals `generate` for every prompt longer than the
  original context (and for everything when max_model_len fits inside it); a shorter prompt with a longer
  max_model_len gets the long factors where transformers would use the short ones.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


class UnsupportedRopeType(NotImplementedError):
    """A rope type (or rope option) tokenmill does not implement; the message is one sentence naming it."""


def rope_parameters(config) -> dict:
    """The rope settings of a HF config as one dict with at least `rope_type` and `rope_theta`.

    transformers 5 spells them `config.rope_parameters`; older configs use `rope_theta` plus `rope_scaling`. As
    transformers' `standardize_rope_params`: a top-level `partial_rotary_factor` fills in a missing one, and for
    llama3 / yarn / longrope a top-level `original_max_position_embeddings` (Phi-3's spelling) wins over the dict's,
    which otherwise defaults to max_position_embeddings.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in _NEEDS_ORIGINAL_MAX:
        top_level = getattr(config, "original_max_position_embeddings", None)
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        elif getattr(config, "max_position_embeddings", None) is not None:
            params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def check_rope_type(params: dict) -> None:
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeType(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )


def rotary_dim(head_dim: int, params: dict) -> int:
    """transformers' `dim`: the leading dimensions of each head that rotate."""
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim


def _default(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim))


def _dynamic_ntk(
    base: float, dim: int, factor: float, max_position_embeddings: int, seq_lens: torch.Tensor
) -> torch.Tensor:
    """`[len(seq_lens), dim / 2]`: transformers' dynamic-NTK inverse frequencies for each (int64) sequence length."""
    seq_lens = torch.clamp(seq_lens, min=max_position_embeddings)
    scaled_base = base * ((factor * seq_lens / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (scaled_base[:, None] ** _exponents(dim)[None, :])


def _yarn(params: dict, dim: int, base: float, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original_max = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(
    params: dict, dim: int, base: float, max_position_embeddings: int, use_long: bool
) -> tuple[torch.Tensor, float]:
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    ext_factors = torch.tensor(params["long_factor" if use_long else "short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (ext_factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_uses_long_factors(params: dict, max_model_len: int | None, max_position_embeddings: int) -> bool:
    """The engine-wide LongRoPE choice (module docstring): long factors when max_model_len passes the original
    context."""
    return (max_model_len or max_position_embeddings) > params["original_max_position_embeddings"]


def inverse_frequencies(
    head_dim: int, params: dict, max_position_embeddings: int, max_model_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(float32 `[rot_dim / 2]` inverse frequencies, attention factor) of every position below
    max_position_embeddings, for any rope type (dynamic NTK rescales only positions past it: `RopeTable`)."""
    check_rope_type(params)
    rope_type = params["rope_type"]
    dim = rotary_dim(head_dim, params)
    base = float(params["rope_theta"])
    if rope_type in ("default", "dynamic"):
        return _default(base, dim), 1.0
    if rope_type == "linear":
        return _default(base, dim) / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(_default(base, dim), params), 1.0
    if rope_type == "yarn":
        return _yarn(params, dim, base, max_position_embeddings)
    use_long = longrope_uses_long_factors(params, max_model_len, max_position_embeddings)
    return _longrope(params, dim, base, max_position_embeddings, use_long)


def rope_table(
    head_dim: int, params: dict, max_position_embeddings: int, num_positions: int, max_model_len: int | None = None
) -> torch.Tensor:
    """float32 `[num_positions, rot_dim]`: cos of position * inv_freq (times the attention factor), then sin."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, params, max_position_embeddings, max_model_len)
    positions = torch.arange(num_positions, dtype=torch.int64)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    if params["rope_type"] == "dynamic" and num_positions > max_position_embeddings:
        past = positions[max_position_embeddings:]
        per_row = _dynamic_ntk(
            float(params["rope_theta"]),
            rotary_dim(head_dim, params),
            float(params["factor"]),
            max_position_embeddings,
            past + 1,
        )
        freqs[max_position_embeddings:] = past.float()[:, None] * per_row
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1).contiguous()
