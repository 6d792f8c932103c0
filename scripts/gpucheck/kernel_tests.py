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
# the split-KV and paged-attention tests first, so they run before any time cap; pytest drops the duplicates
GPU_TESTS = [
    "tests/kernels/test_kernel_split_kv_decode.py",
    "tests/workers/test_triton_split_kv_decode.py",
    "tests/kernels/test_kernel_paged_attention.py",
    "tests/kernels/test_kernel_sliding_window.py",
    "tests/kernels",
    "tests/workers/test_sampler.py",
]
# CPU-only: the C++ kernels, GGUF repacking, and the no-GPU cubin compile check (the GPU compiles them for real)
GPU_DESELECT = [
    "tests/kernels/test_cpu_ops.py",
    "tests/kernels/test_cpu_short_query_attention.py",
    "tests/kernels/test_gguf_cpu_kernels.py",
    "tests/kernels/test_gguf_repacked.py",
    "tests/kernels/test_kernel_cuda_compile.py",
]
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
    return command + GPU_TESTS + [f"--ignore={path}" for path in GPU_DESELECT]


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
    passed = returncode == 0
    summary = [
        f"pytest: {details.get('tests', '?')} tests, {details.get('failures', '?')} failures, "
        f"{details.get('errors', '?')} errors, {details.get('skipped', '?')} skipped"
        + (" (stopped at the time cap)" if timed_out else "")
    ]
    summary += [f"- {failure}" for failure in details.get("failed_tests", [])[:10]]
    return SectionResult(passed, details, summary)
