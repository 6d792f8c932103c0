"""PNG plots of benchmark results: latency CDFs per run, and throughput and latency against concurrency."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))


def plot_latency_cdfs(runs: list[tuple[str, dict[str, list[float]]]], path: Path) -> Path:
    """One panel per latency metric, one CDF line per run; `runs` is [(label, {"ttft_ms": [...], ...})]."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, LATENCIES):
        for label, samples in runs:
            values = np.sort(np.asarray(samples.get(key, []), dtype=float))
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(concurrencies: list[int], summaries: list[dict], path: Path) -> Path:
    """Output and request throughput, and mean/p99 TTFT and TPOT, against concurrency."""
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_tput.plot(concurrencies, [s["output_throughput"] for s in summaries], "o-", label="output tokens/s")
    ax_tput.plot(concurrencies, [s["total_token_throughput"] for s in summaries], "s--", label="total tokens/s")
    ax_tput.set_xlabel("max concurrency")
    ax_tput.set_ylabel("tokens/s")
    ax_tput.set_title("throughput vs concurrency")
    ax_req = ax_tput.twinx()
    ax_req.plot(concurrencies, [s["request_throughput"] for s in summaries], "^:", color="gray", label="requests/s")
    ax_req.set_ylabel("requests/s")
    lines = ax_tput.get_legend_handles_labels()
    extra = ax_req.get_legend_handles_labels()
    ax_tput.legend(lines[0] + extra[0], lines[1] + extra[1], fontsize="small", loc="upper left")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        ax_lat.plot(concurrencies, [s[key]["mean"] for s in summaries], "o-", label=f"mean {label}")
        ax_lat.plot(concurrencies, [s[key]["p99"] for s in summaries], "x--", label=f"p99 {label}")
    ax_lat.set_xlabel("max concurrency")
    ax_lat.set_ylabel("ms")
    ax_lat.set_yscale("log")
    ax_lat.set_title("latency vs concurrency")
    ax_lat.legend(fontsize="small")
    for ax in (ax_tput, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
