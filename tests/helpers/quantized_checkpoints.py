"""Test quantizers: dense weights into the AWQ, GPTQ and FP8 layouts, and whole quantized checkpoints.

`quantize_int4` is round-to-nearest (what AWQ and GPTQ store, not how they choose it): per group of input rows, per
output column, an asymmetric (min/max, zero point) or symmetric (zero point 8) 4-bit grid with fp16 scales.
`write_quantized_checkpoint` turns a dense safetensors checkpoint (tests/helpers/checkpoints.py) into an AWQ, GPTQ or
FP8 one with its `quantization_config`, and also writes the dense checkpoint holding exactly the dequantized weights, so
an engine run on each can be compared token for token.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import torch

from tokenmill.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX
from tokenmill.kernels.int4_gemm import AWQ_ORDER, pack_int4

# the linear layers a quantizer converts (AutoAWQ / GPTQ / llm-compressor leave embeddings, norms and lm_head)
QUANTIZED_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


class Int4Quantized(NamedTuple):
    codes: torch.Tensor  # int64 [K, N] in 0..15
    zeros: torch.Tensor  # int64 [num_groups, N] in 0..15 (8 when symmetric)
    scales: torch.Tensor  # fp16 [num_groups, N]
    g_idx: torch.Tensor  # int32 [K]: each input row's group

    def dense(self) -> torch.Tensor:
        """The `[N, K]` weight these stand for, in float64."""
        groups = self.g_idx.long()
        return ((self.codes - self.zeros[groups]).double() * self.scales.double()[groups]).T


def quantize_int4(
    weight: torch.Tensor, group_size: int, sym: bool = False, perm: torch.Tensor | None = None, min_zero: int = 0
) -> Int4Quantized:
    """Quantize `weight [N, K]`; `perm` (act-order) lists input rows in the order their groups are cut from it;
    `min_zero=1` keeps zero points storable by GPTQ v1 (which saves zero - 1 in four bits)."""
    w = weight.double().T  # [K, N]
    k, n = w.shape
    group_size = group_size if group_size > 0 else k
    order = perm if perm is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    num_groups = k // group_size
    scales = torch.empty(num_groups, n, dtype=torch.float16)
    zeros = torch.empty(num_groups, n, dtype=torch.int64)
    for group in range(num_groups):
        rows = w[g_idx == group]
        if sym:
            scale = (rows.abs().amax(0) * 2 / 15).clamp(min=1e-6)
            zero = torch.full((n,), 8, dtype=torch.int64)
        else:
            low, high = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scale = ((high - low) / 15).clamp(min=1e-6)
            zero = (-low / scale).round().clamp(min_zero, 15).long()
        scales[group] = scale.half()
        zeros[group] = zero
    stored_scales = scales.double()[g_idx.long()]
    codes = (w / stored_scales).round() + zeros[g_idx.long()]
    return Int4Quantized(codes.clamp(0, 15).long(), zeros, scales, g_idx)


def awq_tensors(q: Int4Quantized, zero_point: bool = True) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors (no act-order in AWQ)."""
    tensors = {"qweight": pack_int4(q.codes, 1, AWQ_ORDER), "scales": q.scales}
    if zero_point:
        tensors["qzeros"] = pack_int4(q.zeros, 1, AWQ_ORDER)
    return tensors


def gptq_tensors(q: Int4Quantized, zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """GPTQ tensors; v1 (`zero_offset=1`) stores each zero point minus one."""
    return {
        "qweight": pack_int4(q.codes, 0),
        "qzeros": pack_int4(q.zeros - zero_offset, 1),
        "scales": q.scales,
        "g_idx": q.g_idx,
    }


def compressed_int4_tensors(q: Int4Quantized, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors: `[out, in]`-shaped, packed along the input dim (codes are the
    signed values + 8), zero points packed along the output dim."""
    n = q.codes.shape[1]
    tensors = {
        "weight_packed": pack_int4(q.codes.T, 1),
        "weight_scale": q.scales.T.contiguous(),
        "weight_shape": torch.tensor([n, q.codes.shape[0]]),
        "weight_g_idx": q.g_idx,
    }
    if not sym:
        tensors["weight_zero_point"] = pack_int4(q.zeros.T, 0)
    return tensors


class FP8Quantized(NamedTuple):
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # float32 [1] or [N]

    def dense(self) -> torch.Tensor:
        return self.weight.double() * self.weight_scale.double().reshape(-1, 1)


def quantize_fp8_weight(weight: torch.Tensor, per_channel: bool) -> FP8Quantized:
    amax = weight.abs().amax(dim=1) if per_channel else weight.abs().amax().reshape(1)
    scale = (amax.float() / FP8_MAX).clamp(min=1e-12)
    return FP8Quantized((weight.float() / scale.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale)


# ---------------------------------------------------------------- whole checkpoints


def _layer_input(name: str) -> str:
    """Layers sharing an input (q/k/v, gate/up) share an act-order permutation, as GPTQ's Hessians make them."""
    return re.sub(r"\.(q|k|v)_proj\.weight$", ".qkv", re.sub(r"\.(gate|up)_proj\.weight$", ".gate_up", name))


def write_quantized_checkpoint(
    dense_dir: Path,
    out_dir: Path,
    reference_dir: Path,
    method: str,
    *,
    group_size: int = 32,
    desc_act: bool = False,
    sym: bool = False,
    per_channel: bool = True,
    static_input_scale: bool = False,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Quantize every decoder linear layer of `dense_dir` ("awq", "gptq", "fp8", or compressed-tensors'
    "compressed-int4" / "compressed-fp8") into `out_dir`, and write the
    float32 checkpoint holding exactly the dequantized weights into `reference_dir`.

    Returns the quantized checkpoint's tensors by name (to check what the reader builds from them).
    """
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed)
    dense = load_file(str(dense_dir / "model.safetensors"))
    quantized, reference, perms = {}, {}, {}
    for name, tensor in dense.items():
        if not QUANTIZED_LAYER.fullmatch(name):
            quantized[name] = reference[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        if method in ("fp8", "compressed-fp8"):
            q = quantize_fp8_weight(tensor, per_channel)
            scale = q.weight_scale.reshape(-1, 1) if method == "compressed-fp8" else q.weight_scale
            quantized[name], quantized[f"{prefix}.weight_scale"] = q.weight, scale
            if static_input_scale:
                quantized[f"{prefix}.input_scale"] = torch.tensor([0.02], dtype=torch.float32)
            reference[name] = q.dense().float()
            continue
        perm = None
        if desc_act:
            perm = perms.setdefault(_layer_input(name), torch.randperm(tensor.shape[1], generator=generator))
        q = quantize_int4(tensor, group_size, sym=sym, perm=perm, min_zero=1 if method == "gptq" else 0)
        if method == "compressed-int4":
            parts = compressed_int4_tensors(q, sym)
        else:
            parts = awq_tensors(q) if method == "awq" else gptq_tensors(q)
        quantized.update({f"{prefix}.{part}": value for part, value in parts.items()})
        reference[name] = q.dense().float()
    config = json.loads((dense_dir / "config.json").read_text())
    if method == "awq":
        quant_config = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    elif method == "gptq":
        quant_config = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": sym,
            "checkpoint_format": "gptq",
        }
    elif method == "fp8":
        quant_config = {
            "quant_method": "fp8",
            "activation_scheme": "static" if static_input_scale else "dynamic",
            "ignored_layers": ["lm_head"],
        }
    else:  # compressed-tensors: one config group for every Linear but the LM head
        if method == "compressed-int4":
            scheme = {
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": sym,
                    "strategy": "group",
                    "group_size": group_size,
                    "actorder": "group" if desc_act else None,
                },
                "input_activations": None,
                "format": "pack-quantized",
            }
        else:
            activations = {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "dynamic": not static_input_scale,
                "strategy": "tensor" if static_input_scale else "token",
            }
            scheme = {
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "channel" if per_channel else "tensor",
                },
                "input_activations": activations,
                "format": "float-quantized",
            }
        quant_config = {
            "quant_method": "compressed-tensors",
            "format": scheme["format"],
            "config_groups": {"group_0": {"targets": ["Linear"], **scheme}},
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
    for directory, tensors, extra in [
        (out_dir, quantized, {"quantization_config": quant_config}),
        (reference_dir, reference, {}),
    ]:
        shutil.copytree(dense_dir, directory, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        (directory / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "model.safetensors"))
    return quantized
