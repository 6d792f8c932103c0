"""(f) The worker's start-up on the device: the memory profile's worst-case step with the sampler's share, and the
CUDA-graph capture plan it then follows (issue 26 items 5 and 7).

A `Worker` (SmolLM2-135M config, bf16, 256 sequences, 2048-token steps) profiles its worst-case step, the forward
and then the sample stage at its costliest (`workers/sample_profile.py`), takes the KV blocks left under 0.9 of
the device, allocates them and captures its decode graphs as its `CapturePlan` says. The report gives the
forward's peak, the whole step's, the sample stage's share, the blocks, the plan and the capture time; and the
plan a tensor-parallel worker would follow (cut at the all-reduces). A dry run profiles on the CPU, the device's
peak statistics read from a count of live tensor bytes (`tests/helpers/live_bytes.py`), and captures nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from gpucheck.common import CheckContext, SectionResult
from gpucheck.models import build_checkpoint

UTILIZATION = 0.9


def profiled_worker(ctx: CheckContext, path: str) -> tuple[Any, int | None]:
    """A loaded Worker whose memory profile has run, and the KV blocks it leaves room for (None on the CPU, where the
    profile runs under the live-bytes stand-in)."""
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from tokenmill.model_source import resolve_config
    from tokenmill.workers.worker import Worker

    num_seqs, batched_tokens = ctx.pick((256, 2048), (8, 64))
    config = resolve_config(
        EngineConfig(
            model=ModelConfig(model=path, dtype="bfloat16"),
            cache=CacheConfig(gpu_memory_utilization=UTILIZATION),
            scheduler=SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=batched_tokens),
            parallel=ParallelConfig(device=ctx.device),
        )
    )
    worker = Worker(config)
    worker.load_model()
    if ctx.device == "cuda":
        return worker, worker.num_kv_blocks_for_budget()
    from tests.helpers.live_bytes import LiveBytes

    with LiveBytes() as live, cuda_stats_from(live):
        worker._profile_peak_memory()
    return worker, None


@contextlib.contextmanager
def cuda_stats_from(live: Any) -> Iterator[None]:
    """While active, torch.cuda's peak statistics (and the calls around them) read from a `LiveBytes` counter."""
    import torch

    stand_ins = {
        "empty_cache": lambda: None,
        "synchronize": lambda device=None: None,
        "reset_peak_memory_stats": lambda device=None: live.reset_peak(),
        "max_memory_reserved": lambda device=None: live.peak,
    }
    saved = {name: getattr(torch.cuda, name) for name in stand_ins}
    for name, stand_in in stand_ins.items():
        setattr(torch.cuda, name, stand_in)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)


def run(ctx: CheckContext) -> SectionResult:
    from tokenmill.workers.capture_plan import plan_cuda_graphs

    path = str(build_checkpoint("smollm2-135m", ctx.work_dir / "checkpoints", "bfloat16", ctx.dry_run))
    worker, num_blocks = profiled_worker(ctx, path)
    profiled = worker.profiled_step
    plan = worker.capture_plan()
    details: dict[str, Any] = {
        "profile_tokens": profiled.num_tokens,
        "weight_bytes": worker.weight_bytes,
        "forward_peak_bytes": profiled.forward_peak,
        "step_peak_bytes": profiled.peak,
        "sampler_bytes": profiled.sampler_bytes,
        "capture_plan": plan.describe(),
        "tensor_parallel_plan": plan_cuda_graphs(worker.config, "cuda", 1, 2).describe(),
    }
    if num_blocks is not None:
        worker.allocate_kv_cache(num_blocks)
        started = time.perf_counter()
        worker.capture_cuda_graphs()
        details.update(num_kv_blocks=num_blocks, capture_s=time.perf_counter() - started)
    mib = 1 / 2**20
    summary = [
        f"worst-case step of {profiled.num_tokens} tokens: forward peak {profiled.forward_peak * mib:.1f} MiB, "
        f"whole step {profiled.peak * mib:.1f} MiB (weights {worker.weight_bytes * mib:.1f} MiB; in a dry run the "
        f"peaks leave them out); the sample stage adds {profiled.sampler_bytes * mib:.1f} MiB",
        f"capture plan: {details['capture_plan']}",
        f"under tensor parallelism: {details['tensor_parallel_plan']}",
    ]
    if "num_kv_blocks" in details:
        blocks, seconds = details["num_kv_blocks"], details["capture_s"]
        summary.append(f"KV blocks at {UTILIZATION}: {blocks}; decode graphs captured in {seconds:.1f} s")
    passed = profiled.peak >= profiled.forward_peak and (ctx.dry_run or plan.captures)
    return SectionResult(passed, details, summary)
