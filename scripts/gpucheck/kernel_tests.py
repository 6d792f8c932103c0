"""(a) The project's GPU tests: the Triton kernel tests (on CUDA, compiled, not interpreted), the sampler's CUDA
cases and the Triton backend's split-KV decode path, through pytest with a time cap; counts and failures from its
JUnit XML.

A dry run runs a few of the same tests (the split-count rule, one interpreted launch) to prove the plumbing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from gpucheck.common import CheckContext, SectionResult

REPO_ROOT = Path(__file__).resolve().parents[2]
# The Triton kernel tests (the split-KV and paged-attention ones first) and the worker tests that run Triton on a
# GPU, named one by one: the folder also holds the C++ CPU kernels' tests, which the first device run (2026-11-27)
# showed do not belong here (one of them crashed pytest on the device's CPU and took every later test with it).
GPU_TESTS = [
    "tests/kernels/test_kernel_split_kv_decode.py",
    "tests/workers/test_triton_split_kv_decode.py",
    "tests/kernels/test_kernel_paged_attention.py",
    "tests/kernels/test_kernel_sliding_window.py",
    "tests/kernels/test_kernel_kv_write.py",
    "tests/kernels/test_kernel_rms_norm.py",
    "tests/kernels/test_kernel_rotary.py",
    "tests/kernels/test_kernel_fp8_gemm.py",
    "tests/kernels/test_kernel_int4_gemm.py",
    "tests/kernels/test_kernel_lora_sgmv.py",
    "tests/kernels/test_kernel_moe_grouped_gemm.py",
    "tests/workers/test_sampler.py",
]
# Not here: tests/workers/test_triton_backend.py and test_triton_mixed_batches.py run the Triton backend on CPU tensors
# under the interpreter by design (the second device run, 2026-11-27: "cannot be accessed from Triton (cpu tensor?)");
# what they check runs on the GPU for real in the correctness section (CUDA graphs on and off, mixed chunked steps).
PARALLEL_WORKERS = 6  # pytest-xdist processes: Triton compiles on the host's cores, the GPU has room for all
DRY_RUN_TESTS = [
    "tests/kernels/test_kernel_split_kv_decode.py::test_split_count_rule",
    "tests/kernels/test_kernel_split_kv_decode.py::test_one_split_writes_the_output_without_a_reduce",
]
MAX_LISTED_FAILURES = 40


def pytest_command(ctx: CheckContext, junit: Path) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "--timeout=300",
        "-W",
        "ignore::DeprecationWarning",
    ]
    if ctx.dry_run:
        return command + DRY_RUN_TESTS
    return command + ["-n", str(PARALLEL_WORKERS)] + GPU_TESTS


def junit_counts(junit: Path) -> dict:
    """Totals and the failing tests' ids from pytest's JUnit XML."""
    root = ElementTree.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {"failed_tests": ["no testsuite in pytest's JUnit XML"]}
    counts: dict = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in suite.iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}: {(problem.get('message') or '')[:200]}")
    counts["failed_tests"] = failed[:MAX_LISTED_FAILURES]
    return counts


def counts_from_output(output: str) -> dict:
    """Outcome counts from `pytest -v` lines, for a run stopped at the cap (it wrote no JUnit XML)."""
    outcomes = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0}
    failed = []
    for line in output.splitlines():
        for outcome in outcomes:
            if f" {outcome}" in line and "::" in line:
                outcomes[outcome] += 1
                if outcome in ("FAILED", "ERROR"):
                    failed.append(line.strip()[:200])
    return {
        "tests": sum(outcomes.values()),
        "failures": outcomes["FAILED"],
        "errors": outcomes["ERROR"],
        "skipped": outcomes["SKIPPED"],
        "failed_tests": failed[:MAX_LISTED_FAILURES],
    }


def run(ctx: CheckContext) -> SectionResult:
    junit = ctx.work_dir / "kernel_tests.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    if not ctx.dry_run:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels
    try:
        completed = subprocess.run(
            pytest_command(ctx, junit),
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=max(ctx.budget_s - 15, 10),
        )
        output, returncode, timed_out = completed.stdout + completed.stderr, completed.returncode, False
    except subprocess.TimeoutExpired as expired:
        # the captured output comes back as bytes here, whatever `text` said
        output = b"".join(part or b"" for part in (expired.stdout, expired.stderr)).decode(errors="replace")
        returncode, timed_out = None, True
    details = junit_counts(junit) if junit.exists() else counts_from_output(output)
    details.update(returncode=returncode, timed_out=timed_out, output_tail=output[-3000:])
    if "Fatal Python error" in output:  # a crash: its stack comes before the (long) list of extension modules
        crash = output.index("Fatal Python error")
        details["crash"] = output[crash : crash + 4000]
    passed = returncode == 0
    summary = [
        f"pytest: {details.get('tests', '?')} tests, {details.get('failures', '?')} failures, "
        f"{details.get('errors', '?')} errors, {details.get('skipped', '?')} skipped"
        + (" (stopped at the time cap)" if timed_out else "")
    ]
    summary += [f"- {failure}" for failure in details.get("failed_tests", [])[:10]]
    if "crash" in details:
        summary += ["", "```", details["crash"][:2500], "```"]
    return SectionResult(passed, details, summary)
