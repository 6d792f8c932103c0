"""Read a checkpoint: its Hugging Face config, the dtype to run it in, and its weights as (HF name, tensor) pairs.

Weights come from safetensors (`model.safetensors`, or shards listed in `model.safetensors.index.json`) or from a
GGUF file, whose llama.cpp tensor names are mapped to HF names. Tensors are yielded one at a time so the model copies
each into its (already placed) parameter and the whole checkpoint is never held in memory twice.

Quantized weights (`ModelConfig.quantization`, resolved by `model_source`): a GGUF file's linear and embedding
weights of the CPU kernels' block types stay quantized on CPU (`GGUFWeight`); other block types, every GGUF weight
on CUDA, and every weight under `--quantization none` are dequantized at load. AWQ/GPTQ/FP8/compressed-tensors
checkpoints are read by their format's reader (`workers/quantization.CHECKPOINT_READERS`), dequantized under
`--quantization none` and on CPU (they are GPU formats: the Triton kernels run only on CUDA). The models' `load`
methods take a `QuantizedWeight` wherever they take a linear weight.

dtype rule (`ModelConfig.dtype`):
- "float32" / "bfloat16" / "float16": used as given, on any device.
- "auto" with a GGUF file: float32 on CPU; bfloat16 on CUDA (float16 where the GPU lacks bfloat16).
- "auto" otherwise: the config's dtype when it is float32 or bfloat16; float16 stays float16 on CUDA but becomes
  float32 on CPU (CPU float16 matmuls are slow or unsupported); no dtype in the config counts as float32 on CPU
  and bfloat16 on CUDA.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from tokenmill.config import ModelConfig
from tokenmill.workers.quantization.base import QuantizedWeight

log = logging.getLogger("tokenmill.model_loader")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` for building a model's (uninitialised) parameters, then restored."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_hf_config(model_cfg: ModelConfig):
    """The model's `transformers.PretrainedConfig`, from `config.json` or from the GGUF file's metadata.

    GGUF metadata names no architecture, so `architectures` is filled in from the model type when missing.
    """
    from transformers import AutoConfig

    from tokenmill.gguf_conversion import cached_gguf_config
    from tokenmill.workers.models.registry import architecture_of

    if model_cfg.gguf_file:
        # transformers reads the config through gguf's GGUFReader, seconds over a tokenizer's arrays: a conversion
        # cached by the frontend's tokenizer (or an earlier start) holds it already
        cached = cached_gguf_config(os.path.join(model_cfg.path, model_cfg.gguf_file))
        if cached is not None:
            hf_config = AutoConfig.from_pretrained(cached)
            hf_config._name_or_path = model_cfg.path  # as read from the file itself
        else:
            hf_config = AutoConfig.from_pretrained(model_cfg.path, gguf_file=model_cfg.gguf_file)
    else:
        hf_config = AutoConfig.from_pretrained(model_cfg.path)
    for key, value in model_cfg.hf_overrides.items():  # vLLM's --hf-overrides
        setattr(hf_config, key, value)
    if not getattr(hf_config, "architectures", None):
        try:
            hf_config.architectures = [architecture_of(hf_config)]
        except ValueError:
            pass  # an unsupported model: the error is raised where a model class is needed
    return hf_config


def _config_dtype(hf_config) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        return _DTYPES.get(value.removeprefix("torch."))
    return value if isinstance(value, torch.dtype) else None


def resolve_dtype(model_cfg: ModelConfig, hf_config, device: torch.device) -> torch.dtype:
    """The dtype weights and activations run in; see the module docstring for the rule."""
    if model_cfg.dtype != "auto":
        return _DTYPES[model_cfg.dtype]
    on_cuda = device.type == "cuda"
    if on_cuda:
        half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        half = torch.float32
    if model_cfg.gguf_file:
        return half
    wanted = _config_dtype(hf_config)
    if wanted == torch.float32 or (wanted == torch.bfloat16 and not on_cuda):
        return wanted
    if wanted == torch.float16:
        return torch.float16 if on_cuda else torch.float32
    return half


def iter_weights(
    model_cfg: ModelConfig, device: torch.device | str = "cpu", wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every checkpoint tensor as (HF parameter name, CPU tensor or QuantizedWeight), with a progress bar.

    `wanted` (a pipeline stage's names): a plain safetensors checkpoint never reads the other tensors; other
    formats yield every tensor and the model skips what it does not hold.

    `model_cfg.quantization` None (a config that did not go through `resolve_config`) follows the checkpoint.
    """
    from tokenmill.model_source import checkpoint_quantization

    stored = checkpoint_quantization(model_cfg.path, model_cfg.gguf_file)
    method = model_cfg.quantization or stored
    if model_cfg.gguf_file:
        keep_quantized = method == "gguf" and torch.device(device).type == "cpu"
        if method == "gguf" and not keep_quantized:
            log.info("dequantizing the GGUF weights at load to the activation dtype: %s has no GGUF kernels", device)
        yield from _iter_gguf(os.path.join(model_cfg.path, model_cfg.gguf_file), keep_quantized)
    elif stored == "none":
        yield from _iter_safetensors(model_cfg.path, wanted)
    else:
        from tokenmill.workers.quantization import checkpoint_reader
        from tokenmill.workers.quantization.checkpoint import dequantized

        weights = checkpoint_reader(stored)(model_cfg)
        if method == "none":
            log.info("--quantization none: dequantizing the %s checkpoint at load", stored)
            weights = dequantized(weights, torch.float32, str(device))
        elif torch.device(device).type != "cuda":  # GPU formats: no CPU kernels (dequantized() logs it once)
            weights = dequantized(weights, torch.float32, str(device))
        yield from weights


# ---------------------------------------------------------------- safetensors


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's safetensors files: the shards named by the index, or the single file."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_file):
        with open(index_file) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {path} (model.safetensors or an index file)")
    return [os.path.join(path, name) for name in found]


def _iter_safetensors(path: str, wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = safetensors_files(path)
    total = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=None) as progress:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if wanted is None or wanted(name):
                        yield name, f.get_tensor(name)
                    progress.update(1)


# ---------------------------------------------------------------- GGUF

_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 (llama.cpp arch "gemma3"): four norms per layer, stored as 1 + w (llama.cpp folds Gemma's offset in).
_GGUF_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_UNUSED = {"rope_freqs"}  # llama3 frequency factors: recomputed from the config instead
_GGUF_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_name_to_hf(name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors the model does not use."""
    match = _GGUF_LAYER_PATTERN.fullmatch(name)
    if match:
        layer, kind, param = match.groups()
        layer_names = _GGUF_GEMMA3_LAYER_NAMES if arch == "gemma3" else _GGUF_LAYER_NAMES
        if kind not in layer_names:
            raise KeyError(f"unknown GGUF tensor {name!r}")
        return f"model.layers.{layer}.{layer_names[kind]}.{param}"
    base, _, param = name.rpartition(".")
    if base in _GGUF_UNUSED:
        return None
    if base not in _GGUF_GLOBAL_NAMES:
        raise KeyError(f"unknown GGUF tensor {name!r}")
    return f"{_GGUF_GLOBAL_NAMES[base]}.{param}"


def unpermute_llama_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in Q/K rows (as transformers' GGUF loader does)."""
    half_rows = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half_rows, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


_GGUF_DENSE_TYPES = {"F32", "F16", "BF16", "F64"}


def _keeps_quantized(hf_name: str, tensor) -> bool:
    """Whether a GGUF tensor is a matrix a layer can run quantized: linear weights and the embedding, not norms."""
    return len(tensor.shape) == 2 and hf_name.endswith(".weight") and not hf_name.endswith("norm.weight")


def _iter_gguf(file: str, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The GGUF file's tensors under HF names; with `keep_quantized`, matrices of the CPU kernels' block types come
    as `GGUFWeight`s, every other block type is dequantized to float32 (one log line names those types)."""
    import gguf

    from tokenmill.gguf_index import read_gguf
    from tokenmill.workers.quantization.gguf import GGUFWeight, supported_types

    reader = read_gguf(file)  # not gguf.GGUFReader: it took 4.6 s over the tokenizer's arrays (tokenmill/gguf_index.py)
    arch = reader.fields.get("general.architecture")
    # llama.cpp permutes Q/K rows only for the llama architecture (Mistral GGUFs are "llama" too).
    permuted_heads = {}  # projection name -> its number of heads
    if arch == "llama":
        num_heads = int(reader.fields["llama.attention.head_count"])
        num_kv_heads = int(reader.fields.get("llama.attention.head_count_kv") or num_heads)
        permuted_heads = {"q_proj": num_heads, "k_proj": num_kv_heads}

    kept = supported_types() if keep_quantized else frozenset()
    block_types = {tensor.tensor_type.name for tensor in reader.tensors} - _GGUF_DENSE_TYPES
    dequantized_types = sorted(name for name in block_types if gguf.GGMLQuantizationType[name] not in kept)
    if keep_quantized and dequantized_types:
        log.info(
            "dequantizing GGUF tensors of type %s to float32 at load: the CPU kernels have no such type",
            ", ".join(dequantized_types),
        )
    elif not keep_quantized and block_types:
        log.info("dequantizing the GGUF %s weights to float32 at load", ", ".join(sorted(block_types)))

    for tensor in tqdm(reader.tensors, desc="Loading GGUF weights", unit="tensor", disable=None):
        hf_name = gguf_name_to_hf(tensor.name, arch)
        if hf_name is None:
            continue
        projection = hf_name.split(".")[-2]
        if tensor.tensor_type in kept and _keeps_quantized(hf_name, tensor):
            in_features, out_features = (int(n) for n in tensor.shape)  # GGUF lists dims innermost first
            blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # a copy out of the memory map
            weight = GGUFWeight(blocks.reshape(out_features, -1), tensor.tensor_type, out_features, in_features)
            if projection in permuted_heads:
                order = unpermute_llama_qk(np.arange(out_features), permuted_heads[projection])
                weight = weight.permute_rows(torch.from_numpy(order))
            yield hf_name, weight
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if arch == "gemma3" and tensor.name.endswith("norm.weight"):
            weights = weights - 1  # back to Gemma's w of (1 + w), as transformers' GGUF loader does
        if projection in permuted_heads:
            weights = unpermute_llama_qk(weights, permuted_heads[projection])
        if not weights.flags.writeable:  # F32 tensors are views of the read-only memory-mapped file
            weights = weights.copy()
        yield hf_name, torch.from_numpy(weights)
