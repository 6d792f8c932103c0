"""The KV cache's dtypes, and storing and reading keys/values with a per-tensor scale (fp8, vLLM's semantics).

A cache in a 16-bit float type other than the model's (`--kv-cache-dtype float16|bfloat16` under a float32 model)
stores `x.to(dtype)` and reads `cache.to(model dtype)`, without scales.

With an fp8 cache a layer stores `(x / scale).to(fp8)` and reads `cache.to(dtype) * scale`, a k_scale for keys and
a v_scale for values (from the checkpoint when it has them, else 1.0). Caches in the model's dtype ignore the scales.
The quotient is taken in float32, as the kernels do, so every path rounds the same value once.

`--kv-cache-dtype` names as vLLM's: "fp8" is e4m3 (the OCP "fn" variant: no infinities, largest finite 448).
Torch has no CPU `index_copy_`/`index_fill_` for fp8, so the torch paths move fp8 caches as their bytes (`as_bytes`).
"""

from __future__ import annotations

import torch

from tokenmill.config import KV_CACHE_DTYPES as KV_CACHE_DTYPE_NAMES

KV_CACHE_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for a `--kv-cache-dtype` name: "auto" is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {name!r}")
    dtype = KV_CACHE_DTYPES[name]
    if not is_fp8(dtype) and dtype.itemsize >= model_dtype.itemsize and dtype != model_dtype:
        raise ValueError(
            f"kv_cache_dtype {name} narrows only a float32 model's cache; this model runs in {model_dtype}: "
            "use kv_cache_dtype='auto' or --dtype float32"
        )
    return dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def saturation_bound(dtype: torch.dtype) -> float:
    """The magnitude an fp8 cache of `dtype` clamps to before converting (0: none). e4m3fn saturates at its largest
    finite, 448, as the C++ CPU kernels and vLLM's do; the clamp is explicit because conversions differ (torch's has
    changed across versions, the GPU's cvt saturates: the second device run, 2026-11-27, found the Triton write and
    torch's reference apart on out-of-range keys). e5m2 overflows to infinity everywhere, as IEEE."""
    return float(torch.finfo(dtype).max) if dtype == torch.float8_e4m3fn else 0.0


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x` as it is stored in a cache of `dtype`: fp8 holds `x / scale` (rounded to nearest even; e4m3fn saturating
    at 448)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    bound = saturation_bound(dtype)
    if not bound:
        return (x.float() / scale if scale != 1.0 else x).to(dtype)
    return (x.float() / scale).clamp(-bound, bound).to(dtype)  # exact in float32 when x is already fp8 or 16-bit


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents in `dtype`: fp8 values times their scale, anything else as it is."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return stored.to(dtype) * scale if scale != 1.0 else stored.to(dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as the uint8 tensor of its bytes (for the index ops torch lacks for fp8); others as they are."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


# A checkpoint's per-layer KV-cache scale tensors, as vLLM reads them (`maybe_remap_kv_scale_name`): suffix after
# `<layer>.self_attn` -> the attention attributes it sets. q/prob scales (fp8 attention math) have no use here.
_KV_SCALE_SUFFIXES = {
    ".k_scale": ("k_scale",),  # compressed-tensors, ModelOpt
    ".v_scale": ("v_scale",),
    ".attn.k_scale": ("k_scale",),
    ".attn.v_scale": ("v_scale",),
    ".kv_scale": ("k_scale", "v_scale"),  # older checkpoints: one scale for both
    ".k_proj.output_scale": ("k_scale",),  # AutoFP8
    ".v_proj.output_scale": ("v_scale",),
    ".q_scale": (),
    ".attn.q_scale": (),
    ".prob_scale": (),
    ".attn.prob_scale": (),
    ".q_proj.output_scale": (),
}


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(attention module path, attributes to set) for a checkpoint's KV-cache scale tensor, else None.

    `model.layers.3.self_attn.k_proj.output_scale` -> ("model.layers.3.self_attn", ("k_scale",)); an empty tuple for
    a scale that is read and dropped.
    """
    head, marker, suffix = name.rpartition(".self_attn")
    if not marker or suffix not in _KV_SCALE_SUFFIXES:
        return None
    return head + marker, _KV_SCALE_SUFFIXES[suffix]


def scale_value(tensor: torch.Tensor, name: str) -> float:
    """A checkpoint scale as a float: the largest when it has several (per head), so that nothing overflows."""
    if tensor.numel() == 0:
        raise ValueError(f"KV-cache scale {name!r} is empty")
    value = float(tensor.float().max())
    if not value > 0 or value == float("inf"):
        raise ValueError(f"KV-cache scale {name!r} must be a positive finite number, got {value}")
    return value


def check_kv_cache_device(dtype: torch.dtype, device: torch.device) -> None:
    """Raise ValueError where the kernels cannot run an fp8 cache: Triton converts fp8 on CUDA from sm_89 on."""
    if is_fp8(dtype) and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"kv_cache_dtype {dtype} needs a GPU of compute capability 8.9 or newer (Ada, Hopper) for "
            f"the Triton kernels' fp8 conversions; this one is {major}.{minor}: use kv_cache_dtype='auto'"
        )
