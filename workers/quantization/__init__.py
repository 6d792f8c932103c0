"""Quantized linear weights: GGUF blocks (CPU kernels), AWQ/GPTQ int4 and FP8 (Triton on CUDA).

Every format is a `QuantizedWeight` (`base.py`) that stands in for a linear layer's dense `[out, in]` parameter and
does its own matmul; `packed_linear.linear` dispatches to it, so the model code is the same for every format.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

import torch

from tokenmill.config import ModelConfig
from tokenmill.workers.quantization.base import QuantizedWeight

WeightItem = tuple[str, "torch.Tensor | QuantizedWeight"]
CheckpointReader = Callable[[ModelConfig], Iterator[WeightItem]]

# --quantization method of a safetensors checkpoint -> "module:function" of its reader, a function
# `(model_cfg) -> Iterator[(hf_name, tensor | QuantizedWeight)]` that yields each quantized linear weight as one
# QuantizedWeight named `<layer>.weight` and every other tensor as it is. Modules are imported on first use (a
# reader may import Triton). GGUF files are read by `model_loader` itself.
CHECKPOINT_READERS: dict[str, str] = {
    "awq": "tokenmill.workers.quantization.awq:read_awq",
    "gptq": "tokenmill.workers.quantization.gptq:read_gptq",
    "fp8": "tokenmill.workers.quantization.fp8:read_fp8",
    "compressed-tensors": "tokenmill.workers.quantization.compressed_tensors:read_compressed_tensors",
}


def checkpoint_reader(method: str) -> CheckpointReader:
    """The reader of a quantized safetensors checkpoint; ValueError for a method without one."""
    if method not in CHECKPOINT_READERS:
        raise ValueError(f"no checkpoint reader for quantization {method!r} (known: {sorted(CHECKPOINT_READERS)})")
    module_name, _, function = CHECKPOINT_READERS[method].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ValueError(f"quantization {method!r} is not available in this build ({module_name} is missing)") from None
    return getattr(module, function)
