"""A roofline for decoding: this machine's measured FLOP/s and memory bandwidth against a model's cost per step.

One decode step at batch B reads every weight once, reads each sequence's KV cache, and computes
2 * (matmul parameters) FLOPs per token plus attention (4 * layers * query width * context per token). Its time is at
least max(bytes / bandwidth, FLOPs / FLOP/s), so B tokens per step bound decode throughput at
B / that time. Both machine figures are measured here, in the same run as the benchmark that uses them:
a large square fp32 matmul for FLOP/s (MKL's or oneDNN's, whichever is faster here) and a copy far larger than the
last-level cache for bandwidth (read + write).

    python scripts/roofline.py [--model ""] [--batch-sizes 1,8,32,128] [--context-len 400]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

MATMUL_SIZE = 2048
COPY_BYTES = 1 << 30  # 1 GiB each way: well beyond any last-level cache


@dataclass
class MachinePeaks:
    matmul_flops: float  # FLOP/s of a large fp32 matmul (the faster library)
    copy_bandwidth: float  # bytes/s, counting the read and the write
    threads: int


@dataclass
class ModelCost:
    """What one decoded token costs: matmul parameters, the weight bytes of a step, and per-token KV and attention."""

    matmul_params: int  # weights multiplied per token (the LM head included, the embedding lookup not)
    weight_bytes: int  # bytes of weights read per step
    kv_bytes_per_token: int  # K and V of one cached token across all layers
    attention_flops_per_context_token: int  # QK and PV FLOPs per new token per cached token

    @classmethod
    def from_hf_config(cls, hf_config, weight_bytes: int, dtype_bytes: int) -> ModelCost:
        hidden = hf_config.hidden_size
        layers = hf_config.num_hidden_layers
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        per_layer = hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * hf_config.intermediate_size
        return cls(
            matmul_params=layers * per_layer + hf_config.vocab_size * hidden,
            weight_bytes=weight_bytes,
            kv_bytes_per_token=2 * layers * kv_width * dtype_bytes,
            attention_flops_per_context_token=4 * layers * q_width,
        )


@dataclass
class DecodeBound:
    batch_size: int
    context_len: float  # mean cached tokens per sequence during the steps
    step_bytes: float
    step_flops: float
    memory_time_s: float
    compute_time_s: float
    tokens_per_s: float  # the bound: batch_size / max(memory_time_s, compute_time_s)
    limited_by: str  # "memory" or "compute"

    @property
    def arithmetic_intensity(self) -> float:
        return self.step_flops / self.step_bytes


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure_matmul_flops(size: int = MATMUL_SIZE, repeats: int = 5) -> float:
    """The faster of torch's two CPU matmuls: `torch.mm` (MKL or OpenBLAS) and oneDNN's linear on a packed weight,
    which the engine's CPU layers use (`workers/models/packed_linear.py`); on AMD CPUs oneDNN is about twice MKL."""
    from tokenmill.workers.models.packed_linear import can_pack, linear, packed

    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    out = torch.empty(size, size, dtype=torch.float32)
    best = _best_time(lambda: torch.mm(a, b, out=out), repeats)
    if can_pack(b):
        b_packed = packed(b)
        best = min(best, _best_time(lambda: linear(a, b_packed), repeats))
    return 2 * size**3 / best


def measure_copy_bandwidth(num_bytes: int = COPY_BYTES, repeats: int = 5) -> float:
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)
    return 2 * num_bytes / _best_time(lambda: dst.copy_(src), repeats)


def measure_machine(repeats: int = 5) -> MachinePeaks:
    """Best of `repeats` for each figure: on a shared machine the best run is the closest to the hardware."""
    return MachinePeaks(
        measure_matmul_flops(repeats=repeats), measure_copy_bandwidth(repeats=repeats), torch.get_num_threads()
    )


def decode_bound(cost: ModelCost, machine: MachinePeaks, batch_size: int, context_len: float) -> DecodeBound:
    step_bytes = cost.weight_bytes + batch_size * context_len * cost.kv_bytes_per_token
    step_flops = batch_size * (2 * cost.matmul_params + context_len * cost.attention_flops_per_context_token)
    memory_time = step_bytes / machine.copy_bandwidth
    compute_time = step_flops / machine.matmul_flops
    step_time = max(memory_time, compute_time)
    return DecodeBound(
        batch_size,
        context_len,
        step_bytes,
        step_flops,
        memory_time,
        compute_time,
        batch_size / step_time,
        "memory" if memory_time >= compute_time else "compute",
    )


def plot_roofline(machine: MachinePeaks, points: list[tuple[str, DecodeBound, float]], path: Path) -> Path:
    """The roofline (attainable FLOP/s against arithmetic intensity) with each (label, bound, achieved tokens/s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ridge = machine.matmul_flops / machine.copy_bandwidth
    intensities = np.logspace(np.log10(ridge) - 3, np.log10(ridge) + 2, 200)
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.loglog(
        intensities,
        np.minimum(machine.matmul_flops, intensities * machine.copy_bandwidth) / 1e9,
        "k-",
        label=f"roofline: {machine.matmul_flops / 1e9:.0f} GFLOP/s, {machine.copy_bandwidth / 1e9:.1f} GB/s",
    )
    for label, bound, achieved_tokens_per_s in points:
        flops_per_token = bound.step_flops / bound.batch_size
        ax.loglog(
            [bound.arithmetic_intensity],
            [achieved_tokens_per_s * flops_per_token / 1e9],
            "o",
            label=f"{label}: {achieved_tokens_per_s / bound.tokens_per_s:.0%} of bound",
        )
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("decode roofline")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def model_cost_for(model: str, dtype: str) -> ModelCost:
    """The cost of `model` (as tokenmill names it) in `dtype`, without starting an engine."""
    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.model_source import resolve_config
    from tokenmill.workers.model_loader import load_hf_config, resolve_dtype
    from tokenmill.workers.models.registry import model_class

    config = resolve_config(EngineConfig(model=ModelConfig(model=model, dtype=dtype)))
    hf_config = load_hf_config(config.model)
    torch_dtype = resolve_dtype(config.model, hf_config, torch.device("cpu"))
    with torch.device("meta"):
        module = model_class(config.model.architecture)(hf_config)
    unique = {id(p): p for p in module.parameters()}.values()
    weight_bytes = sum(p.numel() for p in unique) * torch_dtype.itemsize
    return ModelCost.from_hf_config(hf_config, weight_bytes, torch_dtype.itemsize)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help='as for `tokenmill serve` ("" = the default model)')
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--context-len", type=float, default=400.0)
    args = parser.parse_args()
    machine = measure_machine()
    cost = model_cost_for(args.model, args.dtype)
    print(json.dumps({"machine": asdict(machine), "model": asdict(cost)}, indent=2))
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        bound = decode_bound(cost, machine, batch_size, args.context_len)
        print(
            f"batch {batch_size:4d}: <= {bound.tokens_per_s:9.1f} tokens/s ({bound.limited_by}-bound; "
            f"memory {bound.memory_time_s * 1e3:.1f} ms, compute {bound.compute_time_s * 1e3:.1f} ms per step)"
        )


if __name__ == "__main__":
    main()
