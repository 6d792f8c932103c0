"""Parse and check vLLM's speculative-decoding JSON (`--speculative-config`, `LLM(speculative_config=...)`).

Accepted shapes, as vLLM's:
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": n, "prompt_lookup_max": m}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}
An unknown key or a bad value is one ValueError naming the key.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.config import SpeculativeConfig

_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "disable_by_batch_size")
# a verification step's tokens grow with k; past this the rejected tail costs more than any acceptance pays back
MAX_SPECULATIVE_TOKENS = 32


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig:
    """A SpeculativeConfig from a JSON string or a dict (None or "" or {}: speculation off)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value or SpeculativeConfig()
    if isinstance(value, str):
        if not value.strip():
            return SpeculativeConfig()
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    if not value:
        return SpeculativeConfig()
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")

    method = value.get("method")
    if method is None and value.get("model"):
        method = "draft_model"  # as vLLM: a draft model named without a method
    if method in ("[ngram]", "ngram"):
        method = "ngram"
    if method not in ("ngram", "draft_model"):
        raise ValueError(f"speculative_config: 'method' must be 'ngram' or 'draft_model', got {method!r}")

    k = value.get("num_speculative_tokens")
    if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config: 'num_speculative_tokens' must be an integer from 1 to "
            f"{MAX_SPECULATIVE_TOKENS}, got {k!r}"
        )

    disable_by_batch_size = value.get("disable_by_batch_size")
    if disable_by_batch_size is not None and (not _is_int(disable_by_batch_size) or disable_by_batch_size < 1):
        raise ValueError(
            f"speculative_config: 'disable_by_batch_size' must be an integer of at least 1, got "
            f"{disable_by_batch_size!r}"
        )

    if method == "ngram":
        if value.get("model") is not None:
            raise ValueError("speculative_config: 'model' is not used by method 'ngram'")
        lookup_min, lookup_max = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        for key, number in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if number is not None and (not _is_int(number) or number < 1):
                raise ValueError(f"speculative_config: {key!r} must be an integer of at least 1, got {number!r}")
        if lookup_min is None and lookup_max is None:  # vLLM's defaults
            lookup_min = lookup_max = 5
        lookup_min = lookup_min if lookup_min is not None else lookup_max
        lookup_max = lookup_max if lookup_max is not None else lookup_min
        if lookup_min > lookup_max:
            raise ValueError(
                f"speculative_config: 'prompt_lookup_min' ({lookup_min}) must not exceed "
                f"'prompt_lookup_max' ({lookup_max})"
            )
        return SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=k,
            prompt_lookup_min=lookup_min,
            prompt_lookup_max=lookup_max,
            disable_by_batch_size=disable_by_batch_size,
        )

    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if value.get(key) is not None:
            raise ValueError(f"speculative_config: {key!r} is only used by method 'ngram'")
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config: method 'draft_model' needs 'model' (a checkpoint directory or hub id)")
    return SpeculativeConfig(
        method="draft_model", num_speculative_tokens=k, model=model, disable_by_batch_size=disable_by_batch_size
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
