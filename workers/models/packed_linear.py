"""Linear layers on CPU through oneDNN, each weight reordered once, after loading, into oneDNN's blocked layout.

torch's `F.linear` on CPU calls MKL's sgemm, which repacks the weight matrix for its kernel on every call. At decode
batch sizes (tens of rows) that repacking costs about as much as the multiply, and on AMD CPUs MKL also takes a
generic code path. oneDNN's linear on a weight reordered once (what torch inductor's CPU freezing does) avoids
both; on the default model a batch-32 decode step's matmuls take less than half as long (docs/benchmarks.md).

A packed weight is an opaque `mkldnn` tensor: it keeps its logical shape, dtype and element count, but has no
storage to read, so packing happens last, after the weights are loaded and counted. A tied LM head gets a packed
copy while the embedding keeps the dense table for its row lookups: one more vocabulary table in memory (113 MB on
the default model) for a quarter off the LM head's time (28 -> 21 ms per batch-32 step, docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import row_ops
from tokenmill.workers.quantization.base import QuantizedWeight

# The row count the reorder is tuned for; any number of rows works with the packed weight.
ROWS_HINT = 32


def can_pack(weight: torch.Tensor | None) -> bool:
    """Whether oneDNN can run this weight's matmuls here: a CPU tensor in float32, or bfloat16 where it is native."""
    if weight is None or weight.device.type != "cpu" or weight.is_mkldnn or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed(weight: torch.Tensor) -> nn.Parameter:
    """`weight` [out, in] reordered for oneDNN, as a parameter that `linear` accepts in place of the dense one."""
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT), requires_grad=False)


class PackableLinear(nn.Linear):
    """An `nn.Linear` (checkpoint names unchanged) whose matmul runs through `linear`, so that
    `layers.pack_linear_weights` may pack its weight: the BERT-family encoders' layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` through oneDNN wherever it can run (a packed weight, or a dense one it reorders per call); a
    quantized weight runs its own kernel."""
    if isinstance(weight, QuantizedWeight):
        out = weight.matmul(x)  # a new tensor: the bias may go in in place, by a kernel a CPU recording replays
        return out if bias is None or row_ops.add_bias_(out, bias) else out + bias
    if weight.is_mkldnn or can_pack(weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
