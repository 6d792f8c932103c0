"""Helpers shared by the benchmark scripts: workloads, latency statistics, result folders, plots, a server launcher."""
