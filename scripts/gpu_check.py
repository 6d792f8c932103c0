"""The prepared run on a lent GPU (issue 26 item 8, run by issue 27): one command, about 8 minutes on an H100,
writing gpu_check.json and gpu_check.md (and gpu_check.log) under $OUT (or --out DIR), the report printed last.

The `run` tool call, to copy as it is (first, here, once: `bash scripts/gpu_wheels.sh` fills the ignored .whl/ with
the four wheels the GPU machine lacks). kind: left out (an H100; an H200 when none is free); carry: [".whl"];
timeout_s: 540; command (three lines, as they are):

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site || exit
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1; python3 scripts/gpu_check.py --out $OUT

The sections share 470 s (the kernel tests and the correctness runs side by side: neither is timed), so with the
machine's start the call ends in about 9 minutes and leaves some of the 15 device-minutes for a rerun of what failed:
the same command with `--only correctness,memory --total-budget 250` (say) appended. Call `give_back` unless
rerunning at once. The report is rewritten under $OUT after each group, so a call stopped at its timeout still
returns the sections done.

Sections, each in its own process with its own time budget (a crash, hang or CUDA error in one never loses the
others; each records pass / fail / error / timeout with its traceback and log tail):
  kernel_tests         (a) the kernel and GPU tests through pytest, Triton compiled
  correctness          (b) greedy vs transformers: fp32 and bf16, CUDA graphs on and off, chunked prefill + prefix cache
  memory               (c) --gpu-memory-utilization 0.9: profiled KV blocks vs peak memory under the worst-case step
  attention_bandwidth  (d) decode attention (old kernel and split-KV) vs a device-to-device copy, batch 1/32/256, 1k/8k
  throughput           (e) tokenmill vs transformers at 256 sequences; per-step host time and GPU idle (torch.profiler)
  startup_profile      (f) the memory profile's worst-case step and the sample stage's share; the CUDA-graph plan
Models are random-weight checkpoints built on the device from SmolLM2-135M's and Qwen2.5-0.5B's real configs
(`scripts/gpucheck/models.py`): the default model's 92 MB wheel cannot travel.

`--dry-run` runs every section on the CPU with tiny sizes (Triton interpreted), as CI does
(tests/test_gpu_check_dry_run.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS.parent
sys.path[:0] = [str(SCRIPTS), str(REPO_ROOT)]

from gpucheck.common import CheckContext  # noqa: E402
from gpucheck.report import environment, markdown_report  # noqa: E402

# name -> (module under gpucheck/, seconds on the GPU); in order: the kernel tests warm Triton's cache for the rest
SECTIONS = {
    "kernel_tests": ("kernel_tests", 150),
    "correctness": ("correctness", 160),
    "memory": ("memory", 90),
    "attention_bandwidth": ("attention_bandwidth", 30),
    "throughput": ("throughput", 150),
    "startup_profile": ("startup_profile", 30),
}
DEFAULT_ORDER = "kernel_tests+correctness,memory,attention_bandwidth,throughput,startup_profile"
TOTAL_BUDGET_S = 470  # inside the run's 540 s timeout, with the wheel install and the start
DRY_RUN_SECTION_BUDGET_S = 900  # the CPU runs everything interpreted or on two cores: budgets are only a guard
MIN_SECTION_S = 15


def run_section_here(name: str, result_file: Path, work_dir: Path, budget_s: float, dry_run: bool) -> int:
    """Child mode: run one section in this process and write its result (or its error and traceback) as JSON."""
    started = time.perf_counter()
    ctx = CheckContext(
        dry_run=dry_run, work_dir=work_dir, budget_s=budget_s, partial_file=result_file.with_suffix(".partial.json")
    )
    try:
        module = importlib.import_module(f"gpucheck.{SECTIONS[name][0]}")
        result = module.run(ctx)
        record = {"status": "pass" if result.passed else "fail", **asdict(result)}
    except BaseException as error:  # recorded, whatever it is: the parent reports it beside the other sections
        record = {
            "status": "error",
            "error": f"{type(error).__name__}: {error}"[:2000],
            "traceback": traceback.format_exc()[-8000:],
        }
    record["seconds"] = time.perf_counter() - started
    result_file.write_text(json.dumps(record, default=str))
    return 0


def start_section(name: str, budget_s: float, work_dir: Path, dry_run: bool, env: dict) -> dict:
    """Start a section as a child process group; `finish_section` waits for it (to its budget) and records it."""
    log_file = work_dir / f"{name}.log"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--section",
        name,
        "--result-file",
        str(work_dir / f"{name}.json"),
        "--work-dir",
        str(work_dir),
        "--budget",
        str(budget_s),
    ] + (["--dry-run"] if dry_run else [])
    with open(log_file, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return {"name": name, "budget_s": budget_s, "child": child, "started": time.perf_counter(), "work_dir": work_dir}


def finish_section(running: dict) -> dict:
    """Wait for a started section up to its budget (then kill its process group); its record, with the log's tail."""
    name, budget_s, child, work_dir = running["name"], running["budget_s"], running["child"], running["work_dir"]
    result_file, log_file = work_dir / f"{name}.json", work_dir / f"{name}.log"
    try:
        child.wait(timeout=max(budget_s - (time.perf_counter() - running["started"]), 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the section and the engine processes it started
        child.wait()
    seconds = time.perf_counter() - running["started"]
    if result_file.exists():
        record = json.loads(result_file.read_text())
    elif seconds >= budget_s:
        record = {"status": "timeout", "error": f"stopped at its {budget_s:.0f} s budget"}
        partial = result_file.with_suffix(".partial.json")
        if partial.exists():
            record["details"] = json.loads(partial.read_text())
    else:
        record = {"status": "error", "error": f"the section's process exited {child.returncode} with no result"}
    log_tail = log_file.read_text(errors="replace")[-6000:]
    return {"name": name, "budget_s": budget_s, **record, "wall_s": seconds, "log_tail": log_tail}


def launch_section(name: str, budget_s: float, work_dir: Path, dry_run: bool, env: dict) -> dict:
    """Run one section as a child process group, killed at its budget; its record."""
    return finish_section(start_section(name, budget_s, work_dir, dry_run, env))


def child_env(dry_run: bool) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if dry_run:
        env["TRITON_INTERPRET"] = "1"  # set before anything imports Triton in the children
    return env


def run_all(groups: list[list[str]], out_dir: Path, dry_run: bool, total_budget_s: float = TOTAL_BUDGET_S) -> dict:
    """Every group of sections in order (a group's sections side by side), within the total budget; the report as
    a dict, also written under `out_dir` after each group (a run stopped from outside still returns what it has)."""
    deadline = time.monotonic() + (sum(map(len, groups)) * DRY_RUN_SECTION_BUDGET_S if dry_run else total_budget_s)
    env = child_env(dry_run)
    report: dict = {"dry_run": dry_run, "environment": environment(), "sections": []}
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        for group in groups:
            running = []
            for name in group:
                budget = DRY_RUN_SECTION_BUDGET_S if dry_run else min(SECTIONS[name][1], deadline - time.monotonic())
                if budget < MIN_SECTION_S:
                    report["sections"].append(
                        {"name": name, "status": "skipped", "error": "the total time budget ran out"}
                    )
                    continue
                print(f"[gpu_check] {name}: up to {budget:.0f} s", flush=True)
                running.append(start_section(name, budget, Path(scratch), dry_run, env))
            for started in running:
                report["sections"].append(finish_section(started))
                section = report["sections"][-1]
                print(f"[gpu_check] {section['name']}: {section['status']} in {section['wall_s']:.0f} s", flush=True)
            write_report(report, out_dir)
    return report


def write_report(report: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    markdown = markdown_report(report)
    (out_dir / "gpu_check.md").write_text(markdown)
    logs = [f"===== {s['name']} ({s['status']})\n{s.get('log_tail', '')}" for s in report["sections"]]
    (out_dir / "gpu_check.log").write_text("\n".join(logs))
    return markdown


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreted")
    parser.add_argument(
        "--only",
        default=DEFAULT_ORDER,
        help="comma-separated sections, in run order; a+b runs a and b side by side (neither timed against the other)",
    )
    parser.add_argument("--total-budget", type=float, default=TOTAL_BUDGET_S, help="seconds for every section")
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.section:
        return run_section_here(args.section, args.result_file, args.work_dir, args.budget, args.dry_run)
    groups = [[name.strip() for name in group.split("+") if name.strip()] for group in args.only.split(",")]
    groups = [group for group in groups if group]
    unknown = [name for group in groups for name in group if name not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    report = run_all(groups, args.out, args.dry_run, args.total_budget)
    print(write_report(report, args.out), flush=True)
    return 0 if all(section["status"] == "pass" for section in report["sections"]) else 1


if __name__ == "__main__":
    sys.exit(main())
