"""GPTQ int4 weights (AutoGPTQ / GPTQModel, `quant_method: "gptq"`): `GPTQWeight` and the checkpoint reader.

Layout (`kernels/int4_gemm.py`): qweight int32 `[in/8, out]` packed along the input dim, qzeros int32
`[in/G, out/8]` packed along the output dim, scales fp16 `[in/G, out]`, and g_idx int32 `[in]` naming each input
row's group. A v1 checkpoint (`checkpoint_format: "gptq"`, the default) stores each zero point minus one; v2 stores it
as is. g_idx matters only for act-order (desc_act) checkpoints, whose rows were quantized in a permuted order; where
it is the plain `k // group_size` the reader drops it so the kernel reads one scale row per tile. On CUDA `matmul`
runs the Triton kernel; elsewhere it multiplies by the dequantized weight. Without qzeros (compressed-tensors'
symmetric int4, `compressed_tensors.py`) the codes are offset by 8.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenmill.config import ModelConfig
from tokenmill.kernels.int4_gemm import PLAIN_ORDER, gptq_dequantize_ref
from tokenmill.workers.model_loader import safetensors_files
from tokenmill.workers.quantization.awq import group_range, slice_packed_columns
from tokenmill.workers.quantization.base import QuantizedWeight
from tokenmill.workers.quantization.checkpoint import int4_config, iter_grouped_tensors, quantization_config


def is_plain_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether g_idx is `k // group_size` for every input row k (no act-order permutation)."""
    return torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group_size)


class GPTQWeight(QuantizedWeight):
    format = "gptq"

    def __init__(
        self,
        qweight: torch.Tensor,
        qzeros: torch.Tensor | None,
        scales: torch.Tensor,
        group_size: int,
        g_idx: torch.Tensor | None = None,
        zero_offset: int = 1,
    ):
        in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
        super().__init__(out_features, in_features)
        self.group_size = group_size if group_size > 0 else in_features
        self.zero_offset = zero_offset
        num_groups = scales.shape[0]
        if (
            scales.shape[1] != out_features
            or out_features % 8
            or (g_idx is None and num_groups * self.group_size != in_features)
        ):
            raise ValueError(
                f"GPTQ scales {tuple(scales.shape)} do not fit a [{out_features}, {in_features}] weight "
                f"with group_size {self.group_size}"
            )
        if qzeros is not None and tuple(qzeros.shape) != (num_groups, out_features // 8):
            raise ValueError(f"GPTQ qzeros has shape {tuple(qzeros.shape)}, expected {(num_groups, out_features // 8)}")
        if g_idx is not None and g_idx.numel() != in_features:
            raise ValueError(f"GPTQ g_idx has {g_idx.numel()} entries for {in_features} input features")
        self.register_buffer("qweight", qweight.to(torch.int32))
        self.register_buffer("qzeros", None if qzeros is None else qzeros.to(torch.int32))
        self.register_buffer("scales", scales)
        self.register_buffer("g_idx", None if g_idx is None else g_idx.to(torch.int32))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tokenmill.kernels.int4_gemm import gptq_gemm

            return gptq_gemm(x, self.qweight, self.qzeros, self.scales, self.group_size, self.g_idx, self.zero_offset)
        return x @ self._dense(x.dtype)

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        """`[in, out]`."""
        return gptq_dequantize_ref(
            self.qweight, self.qzeros, self.scales, self.group_size, self.g_idx, self.zero_offset, dtype
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._dense(dtype).T.contiguous()

    def rows(self, start: int, count: int) -> GPTQWeight:
        zeros = None if self.qzeros is None else slice_packed_columns(self.qzeros, start, count, PLAIN_ORDER)
        return GPTQWeight(
            self.qweight[:, start : start + count].contiguous(),
            zeros,
            self.scales[:, start : start + count].contiguous(),
            self.group_size,
            self.g_idx,
            self.zero_offset,
        )

    def cols(self, start: int, count: int) -> GPTQWeight:
        if start % 8 or count % 8:
            raise ValueError(
                f"GPTQ cols: input columns [{start}, {start + count}) are not on the packing's 8-row boundaries"
            )
        qweight = self.qweight[start // 8 : (start + count) // 8].contiguous()
        if self.g_idx is not None:  # act-order: the columns may use any group; keep them all
            return GPTQWeight(
                qweight,
                self.qzeros,
                self.scales,
                self.group_size,
                self.g_idx[start : start + count].contiguous(),
                self.zero_offset,
            )
        groups = group_range(start, count, self.group_size, "GPTQ cols")
        zeros = None if self.qzeros is None else self.qzeros[groups].contiguous()
        return GPTQWeight(qweight, zeros, self.scales[groups].contiguous(), self.group_size, None, self.zero_offset)

    @classmethod
    def concat_rows(cls, parts: list[GPTQWeight]) -> GPTQWeight | None:
        first = parts[0]
        for p in parts:
            same_g_idx = (p.g_idx is None and first.g_idx is None) or (
                p.g_idx is not None and first.g_idx is not None and torch.equal(p.g_idx, first.g_idx)
            )
            if (
                not same_g_idx
                or p.group_size != first.group_size
                or p.in_features != first.in_features
                or (
                    p.zero_offset != first.zero_offset
                    or (p.qzeros is None) != (first.qzeros is None)
                    or p.scales.shape[0] != first.scales.shape[0]
                    or p.scales.dtype != first.scales.dtype
                )
            ):
                return None
        zeros = None if first.qzeros is None else torch.cat([p.qzeros for p in parts], dim=1)
        return GPTQWeight(
            torch.cat([p.qweight for p in parts], dim=1),
            zeros,
            torch.cat([p.scales for p in parts], dim=1),
            first.group_size,
            first.g_idx,
            first.zero_offset,
        )


def gptq_zero_offset(config: dict) -> int:
    """1 for v1 checkpoints (zero points stored minus one), 0 for `checkpoint_format: "gptq_v2"`."""
    checkpoint_format = config.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported (gptq or gptq_v2)")
    return 0 if checkpoint_format == "gptq_v2" else 1


def read_gptq(model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each layer's qweight/qzeros/scales/g_idx as one `GPTQWeight` named
    `<prefix>.weight` (modules left unquantized, `modules_to_not_convert`, are stored dense and pass through)."""
    config = quantization_config(model_cfg.path)
    settings = int4_config(config, "gptq")
    zero_offset = gptq_zero_offset(config)
    for name, item in iter_grouped_tensors(safetensors_files(model_cfg.path), ("qweight", "qzeros", "scales", "g_idx")):
        if not isinstance(item, dict):
            yield name, item
            continue
        missing = [part for part in ("qzeros", "scales") if part not in item]
        if missing:
            raise ValueError(f"GPTQ checkpoint has {name}.qweight but no {name}.{missing[0]}")
        group_size = settings.group_size if settings.group_size > 0 else item["qweight"].shape[0] * 8
        g_idx = item.get("g_idx")
        if g_idx is None and settings.desc_act and settings.group_size > 0:
            raise ValueError(f"GPTQ checkpoint has desc_act=true but no {name}.g_idx (act-order needs it)")
        if g_idx is not None and is_plain_g_idx(g_idx, group_size):
            g_idx = None
        yield (
            f"{name}.weight",
            GPTQWeight(item["qweight"], item["qzeros"], item["scales"], group_size, g_idx, zero_offset),
        )
