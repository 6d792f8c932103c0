"""How an embedding model wants to be pooled, read from its files; torch-free, so the frontend can check requests.

`load_pooling_config` reads the model's sentence-transformers files (`modules.json`, `1_Pooling/config.json`, old and
new spellings), falling back to mean pooling for encoders and last-token pooling for decoders, both L2-normalized;
it also finds the Matryoshka output sizes a model declares. `check_dimensions` validates the OpenAI `dimensions`
field. The pooling itself is `workers/pooling.py`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Literal

import msgspec

log = logging.getLogger(__name__)

PoolingMode = Literal["mean", "cls", "last"]
POOLING_MODES: tuple[str, ...] = ("mean", "cls", "last")

# sentence-transformers pooling mode -> ours (the others, max / mean_sqrt_len_tokens / weightedmean, are not served)
_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
# pre-v5 1_Pooling/config.json spelled the mode as one bool per mode, in this order
_ST_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# modules.json entries we can reproduce; anything else (Dense, LayerNorm, ...) changes the vector and is refused
_ST_SUPPORTED_MODULES = {"Transformer", "Pooling", "Normalize"}
_README_MATRYOSHKA = re.compile(r"[\"']?matryoshka_dim(?:ension)?s[\"']?\s*[:=]\s*\[([0-9,\s]+)\]")


class PoolingConfig(msgspec.Struct, frozen=True):
    mode: PoolingMode
    normalize: bool
    # output sizes the model was trained to be truncated to (Matryoshka), largest first; [] when it declares
    # Matryoshka support without a list (any size is fine); None when it declares none
    matryoshka_dims: list[int] | None = None


def load_pooling_config(
    model_dir: str,
    architecture: str,
    mode_override: str | None = None,
    normalize_override: bool | None = None,
) -> PoolingConfig:
    """The model's pooling: from its sentence-transformers files, else by architecture; overrides win."""
    directory = Path(model_dir)
    st_mode, normalize = _read_sentence_transformers(directory)
    if mode_override is not None:
        if mode_override not in POOLING_MODES:
            raise ValueError(f"pooling mode {mode_override!r} is not one of {', '.join(POOLING_MODES)}")
        mode = mode_override
    elif st_mode is not None:
        if st_mode not in _ST_MODES:
            raise ValueError(
                f"the model's sentence-transformers pooling {st_mode!r} is not supported "
                f"(only mean, cls, lasttoken); choose one with --pooling"
            )
        mode = _ST_MODES[st_mode]
    else:
        mode = "last" if is_decoder_architecture(architecture) else "mean"
    if normalize_override is not None:
        normalize = normalize_override
    elif normalize is None:
        normalize = True
    return PoolingConfig(mode, normalize, _read_matryoshka_dims(directory))


def is_decoder_architecture(architecture: str) -> bool:
    return "CausalLM" in architecture


def _read_json(path: Path) -> dict | list | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_sentence_transformers(directory: Path) -> tuple[str | None, bool | None]:
    """(sentence-transformers pooling mode name, normalize); None for what the files do not say."""
    modules = _read_json(directory / "modules.json")
    if modules is None:
        return _read_st_pooling_mode(directory / "1_Pooling" / "config.json"), None
    normalize = False
    st_mode = None
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind not in _ST_SUPPORTED_MODULES:
            raise ValueError(
                f"the model's sentence-transformers module {kind!r} ({module.get('path')}) is not supported"
            )
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            st_mode = _read_st_pooling_mode(directory / module.get("path", "1_Pooling") / "config.json")
    return st_mode, normalize


def _read_st_pooling_mode(path: Path) -> str | None:
    config = _read_json(path)
    if config is None:
        return None
    if config.get("include_prompt", True) is False:
        log.warning("%s excludes prompt tokens from pooling; tokenmill pools every token", path)
    mode = config.get("pooling_mode")
    if mode is None:
        active = [name for key, name in _ST_LEGACY_MODE_KEYS.items() if config.get(key, False)]
        mode = active or ["mean"]  # sentence-transformers' own default when no flag is set
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else "+".join(mode)  # a concatenation of modes: not supported
    return mode


def _read_matryoshka_dims(directory: Path) -> list[int] | None:
    """Matryoshka sizes from config.json, config_sentence_transformers.json, or the model card's training args."""
    declared_any = False
    for name in ("config.json", "config_sentence_transformers.json"):
        config = _read_json(directory / name) or {}
        dims = config.get("matryoshka_dimensions") or config.get("matryoshka_dims")
        if dims:
            return sorted({int(d) for d in dims}, reverse=True)
        declared_any = declared_any or bool(config.get("is_matryoshka", False))
    readme = directory / "README.md"
    if readme.is_file():
        match = _README_MATRYOSHKA.search(readme.read_text(encoding="utf-8", errors="replace"))
        if match:
            dims = [int(d) for d in match.group(1).replace(",", " ").split()]
            if dims:
                return sorted(set(dims), reverse=True)
    return [] if declared_any else None


def check_dimensions(dimensions: int, hidden_size: int, config: PoolingConfig, allow_any: bool) -> None:
    """Raise ValueError (a message for the API user) unless embeddings may be truncated to `dimensions`."""
    if not 1 <= dimensions <= hidden_size:
        raise ValueError(f"dimensions must be between 1 and {hidden_size}, got {dimensions}")
    if dimensions == hidden_size or allow_any or config.matryoshka_dims == []:
        return
    if config.matryoshka_dims is None:
        raise ValueError("this model does not support the dimensions parameter (it declares no Matryoshka sizes)")
    if dimensions not in config.matryoshka_dims:
        sizes = ", ".join(map(str, config.matryoshka_dims))
        raise ValueError(f"dimensions must be one of this model's Matryoshka sizes ({sizes}), got {dimensions}")
