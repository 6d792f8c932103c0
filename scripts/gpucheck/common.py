"""What every section of the device run shares: its context (mode, device, scratch folder), timing, and outcomes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CheckContext:
    """One section's run: `dry_run` means CPU with tiny sizes (Triton interpreted), else the GPU at full size."""

    dry_run: bool
    work_dir: Path  # scratch: checkpoints, pytest output (never under $OUT, which returns only a few files)
    budget_s: float
    partial_file: Path | None = None  # where `save_partial` leaves what a section has so far

    def save_partial(self, details: dict[str, Any]) -> None:
        """Record the figures so far: a section stopped at its budget is reported with them."""
        if self.partial_file is not None:
            self.partial_file.write_text(json.dumps(details, default=str))

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def engine_args(self) -> dict[str, Any]:
        """Engine arguments every section's `LLM` takes: on the CPU a small KV budget (the default is 4 GiB)."""
        return {"device": self.device, **({"kv_cache_memory_bytes": 64 << 20} if self.dry_run else {})}

    def pick(self, full: Any, dry: Any) -> Any:
        """`full` on the GPU, `dry` in a dry run: the one place sizes differ between the two."""
        return dry if self.dry_run else full


@dataclass
class SectionResult:
    """What a section reports: pass/fail and its figures (JSON-ready). An exception makes the runner record an error."""

    passed: bool
    details: dict[str, Any] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)  # markdown lines for the report


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def median_time_s(fn: Callable[[], object], device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of `fn` (CUDA events via triton's do_bench on the GPU; perf_counter on the CPU)."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) / 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]
