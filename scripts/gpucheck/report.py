"""The device run's report: the machine it ran on (read without touching CUDA) and the markdown of every section."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess

PACKAGES = ("torch", "triton", "transformers", "msgspec", "pyzmq", "llguidance", "gguf")


def gpu_names() -> list[str]:
    """nvidia-smi's name, memory and driver per GPU (no CUDA context in this process); [] without one."""
    try:
        completed = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in completed.stdout.splitlines() if line.strip()]


def environment() -> dict:
    versions: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "gpus": gpu_names(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "packages": versions,
    }


def section_markdown(section: dict) -> list[str]:
    budget = section.get("budget_s")
    timing = f" ({section['wall_s']:.0f} s of {budget:.0f} s)" if "wall_s" in section and budget else ""
    lines = [f"## {section['name']}: {section['status'].upper()}{timing}", ""]
    lines += section.get("summary") or []
    if section.get("error"):
        lines += ["", f"**{section['error']}**"]
    if section.get("traceback"):
        lines += ["", "```", section["traceback"].rstrip()[-3000:], "```"]
    elif section["status"] in ("error", "timeout") and section.get("log_tail"):
        lines += ["", "log tail:", "```", section["log_tail"].rstrip()[-2000:], "```"]
    return lines + [""]


def markdown_report(report: dict) -> str:
    env = report["environment"]
    device = "; ".join(env["gpus"]) or "no GPU"
    packages = ", ".join(f"{name} {version}" for name, version in env["packages"].items() if version)
    lines = [
        "# tokenmill GPU check" + (" (dry run: CPU, tiny sizes)" if report["dry_run"] else ""),
        "",
        f"device: {device}",
        f"python {env['python']} ({env['machine']}); {packages}",
        "",
        "| section | status | seconds |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {s['name']} | {s['status']} | {s.get('wall_s', 0):.0f} |" for s in report["sections"]]
    lines.append("")
    for section in report["sections"]:
        lines += section_markdown(section)
    return "\n".join(lines)
