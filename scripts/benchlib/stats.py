"""Summary statistics of latency samples, and plain-text tables of them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, median, p90, p99 (and count) of `values` times `scale`; NaNs when there are none."""
    if len(values) == 0:
        return {"count": 0, "mean": float("nan"), "median": float("nan"), "p90": float("nan"), "p99": float("nan")}
    array = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(array, PERCENTILES)
    return {
        "count": int(array.size),
        "mean": float(array.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
    }


def format_table(title: str, rows: list[tuple[str, str]]) -> str:
    """A two-column table under a title, as vLLM's benchmark prints it."""
    width = max(50, max(len(k) + len(v) + 2 for k, v in rows) if rows else 0)
    lines = [f"{f' {title} ':=^{width}}"]
    lines += [f"{key:<{width - len(value)}}{value}" for key, value in rows]
    lines.append("=" * width)
    return "\n".join(lines)


def latency_rows(name: str, summary: dict[str, float], unit: str = "ms") -> list[tuple[str, str]]:
    return [
        (f"{label} {name} ({unit}):", f"{summary[key]:.2f}")
        for label, key in (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P99", "p99"))
    ]
