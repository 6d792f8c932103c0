"""AWQ int4 weights (AutoAWQ's GEMM layout, `quant_method: "awq"`): `AWQWeight` and the checkpoint reader.

Layout (`kernels/int4_gemm.py`): qweight int32 `[in, out/8]` packed along the output dim in AWQ's nibble order,
qzeros int32 `[in/G, out/8]` packed the same way (absent with `zero_point: false`: codes offset by 8), scales fp16
`[in/G, out]`. On CUDA `matmul` runs the Triton kernel; elsewhere it multiplies by the dequantized weight.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenmill.config import ModelConfig
from tokenmill.kernels.int4_gemm import AWQ_ORDER, awq_dequantize_ref, pack_int4, unpack_int4
from tokenmill.workers.model_loader import safetensors_files
from tokenmill.workers.quantization.base import QuantizedWeight
from tokenmill.workers.quantization.checkpoint import (
    int4_config,
    iter_grouped_tensors,
    quantization_config,
)


def slice_packed_columns(packed: torch.Tensor, start: int, count: int, order: tuple[int, ...]) -> torch.Tensor:
    """Columns [start, start + count) of a tensor packed eight columns to an int32 along its last dim."""
    if start % 8 == 0 and count % 8 == 0:
        return packed[:, start // 8 : (start + count) // 8].contiguous()
    if count % 8:
        raise ValueError(f"cannot take {count} columns of a packed int4 tensor: not a multiple of 8")
    return pack_int4(unpack_int4(packed, 1, order)[:, start : start + count], 1, order)


def group_range(start: int, count: int, group_size: int, what: str) -> slice:
    """The groups covering input columns [start, start + count), which must fall on group boundaries."""
    if start % group_size or count % group_size:
        raise ValueError(
            f"{what}: input columns [{start}, {start + count}) do not fall on group boundaries "
            f"(group_size {group_size})"
        )
    return slice(start // group_size, (start + count) // group_size)


class AWQWeight(QuantizedWeight):
    format = "awq"

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor, group_size: int):
        in_features, out_features = qweight.shape[0], scales.shape[1]
        super().__init__(out_features, in_features)
        self.group_size = group_size if group_size > 0 else in_features
        if in_features % self.group_size:
            raise ValueError(f"AWQ group_size {self.group_size} does not divide in_features {in_features}")
        num_groups = in_features // self.group_size
        expected = [
            ("qweight", qweight, (in_features, out_features // 8)),
            ("scales", scales, (num_groups, out_features)),
        ]
        if qzeros is not None:
            expected.append(("qzeros", qzeros, (num_groups, out_features // 8)))
        for name, tensor, shape in expected:
            if tuple(tensor.shape) != shape or out_features % 8:
                raise ValueError(
                    f"AWQ {name} has shape {tuple(tensor.shape)}, expected {shape} for a "
                    f"[{out_features}, {in_features}] weight with group_size {self.group_size}"
                )
        self.register_buffer("qweight", qweight.to(torch.int32))
        self.register_buffer("qzeros", None if qzeros is None else qzeros.to(torch.int32))
        self.register_buffer("scales", scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tokenmill.kernels.int4_gemm import awq_gemm

            return awq_gemm(x, self.qweight, self.qzeros, self.scales, self.group_size)
        return x @ awq_dequantize_ref(self.qweight, self.qzeros, self.scales, self.group_size, x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return awq_dequantize_ref(self.qweight, self.qzeros, self.scales, self.group_size, dtype).T.contiguous()

    def rows(self, start: int, count: int) -> AWQWeight:
        zeros = None if self.qzeros is None else slice_packed_columns(self.qzeros, start, count, AWQ_ORDER)
        return AWQWeight(
            slice_packed_columns(self.qweight, start, count, AWQ_ORDER),
            zeros,
            self.scales[:, start : start + count].contiguous(),
            self.group_size,
        )

    def cols(self, start: int, count: int) -> AWQWeight:
        groups = group_range(start, count, self.group_size, "AWQ cols")
        zeros = None if self.qzeros is None else self.qzeros[groups].contiguous()
        return AWQWeight(
            self.qweight[start : start + count].contiguous(), zeros, self.scales[groups].contiguous(), self.group_size
        )

    @classmethod
    def concat_rows(cls, parts: list[AWQWeight]) -> AWQWeight | None:
        first = parts[0]
        if any(
            p.group_size != first.group_size
            or p.in_features != first.in_features
            or (p.qzeros is None) != (first.qzeros is None)
            or p.scales.dtype != first.scales.dtype
            for p in parts
        ):
            return None
        zeros = None if first.qzeros is None else torch.cat([p.qzeros for p in parts], dim=1)
        return AWQWeight(
            torch.cat([p.qweight for p in parts], dim=1),
            zeros,
            torch.cat([p.scales for p in parts], dim=1),
            first.group_size,
        )


def read_awq(model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each layer's qweight/qzeros/scales as one `AWQWeight` named `<prefix>.weight`."""
    config = quantization_config(model_cfg.path)
    settings = int4_config(config, "awq")
    if config.get("version", "gemm").lower() != "gemm":
        raise ValueError(f"AWQ version {config['version']!r} is not supported (only the GEMM layout)")
    zero_point = bool(config.get("zero_point", True))
    for name, item in iter_grouped_tensors(safetensors_files(model_cfg.path), ("qweight", "qzeros", "scales")):
        if not isinstance(item, dict):
            yield name, item
            continue
        if "scales" not in item or (zero_point and "qzeros" not in item):
            missing = "scales" if "scales" not in item else "qzeros (zero_point is true)"
            raise ValueError(f"AWQ checkpoint has {name}.qweight but no {name}.{missing}")
        yield f"{name}.weight", AWQWeight(item["qweight"], item.get("qzeros"), item["scales"], settings.group_size)
