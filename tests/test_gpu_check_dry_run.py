"""scripts/gpu_check.py, the prepared GPU run, in its CPU dry run (every section, tiny sizes, Triton interpreted), so
no device minute is lost to an error a CPU could catch; and its runner's records of a section that fails or hangs."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "gpu_check.py"
SECTIONS = ["kernel_tests", "correctness", "memory", "attention_bandwidth", "throughput", "startup_profile"]
DETAIL_KEYS = {
    "kernel_tests": {"tests", "failures", "errors", "returncode"},
    "correctness": {"runs", "max_tokens"},
    "memory": {"num_kv_blocks", "block_size", "peak_used_bytes", "generated_tokens"},
    "attention_bandwidth": {"copy_gbps", "num_sms", "sizes"},
    "throughput": {"throughput", "decode_profile"},
    "startup_profile": {"forward_peak_bytes", "step_peak_bytes", "sampler_bytes", "capture_plan"},
}


@pytest.fixture(scope="module")
def gpu_check():
    sys.path[:0] = [str(REPO_ROOT / "scripts")]
    import gpu_check

    yield gpu_check
    sys.path.remove(str(REPO_ROOT / "scripts"))


def test_dry_run_passes_and_writes_the_report(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO_ROOT,
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = {s["name"]: s.get("error") or s.get("summary") for s in report["sections"] if s["status"] != "pass"}
    assert completed.returncode == 0 and not failed, (failed, completed.stdout[-3000:], completed.stderr[-3000:])
    assert [section["name"] for section in report["sections"]] == SECTIONS
    for section in report["sections"]:
        assert DETAIL_KEYS[section["name"]] <= section["details"].keys(), section["name"]
        assert section["summary"], section["name"]
    assert report["dry_run"] is True and "torch" in report["environment"]["packages"]
    correctness = report["sections"][1]["details"]["runs"]
    assert correctness and all(run["rounds"][0]["tokens_compared"] > 0 for run in correctness)
    assert all(run["cached_tokens_round_two"] > 0 for run in correctness)  # the second round hit the prefix cache
    sizes = report["sections"][3]["details"]["sizes"]
    assert all(size["split_kv_relative_error"] < 1e-2 and size["old_relative_error"] < 1e-2 for size in sizes)
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown in completed.stdout  # the report is printed at the end
    assert all(f"## {name}: PASS" in markdown for name in SECTIONS)
    assert (tmp_path / "gpu_check.log").exists()


def test_a_failing_section_is_recorded_with_its_traceback(gpu_check, tmp_path, monkeypatch):
    def explode(ctx):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(sys.modules, "gpucheck.memory", types.SimpleNamespace(run=explode))
    result_file = tmp_path / "memory.json"
    gpu_check.run_section_here("memory", result_file, tmp_path, 10.0, dry_run=True)
    record = json.loads(result_file.read_text())
    assert record["status"] == "error" and "illegal memory access" in record["error"]
    assert "explode" in record["traceback"]
    markdown = gpu_check.markdown_report(
        {
            "dry_run": True,
            "environment": {"gpus": [], "python": "3", "machine": "x", "packages": {}},
            "sections": [{"name": "memory", **record}],
        }
    )
    assert "## memory: ERROR" in markdown and "illegal memory access" in markdown


def test_a_section_past_its_budget_is_stopped_and_keeps_its_partial_figures(gpu_check, tmp_path):
    # what the section saved before its budget ran out (here, before it even started) is reported
    (tmp_path / "throughput.partial.json").write_text(json.dumps({"throughput": [{"model": "smollm2-135m"}]}))
    record = gpu_check.launch_section("throughput", 0.5, tmp_path, True, gpu_check.child_env(dry_run=True))
    assert record["status"] == "timeout" and record["wall_s"] < 30
    assert record["details"] == {"throughput": [{"model": "smollm2-135m"}]}


def test_pytest_counts_survive_a_run_stopped_at_the_cap(gpu_check):
    from gpucheck.kernel_tests import counts_from_output

    output = (
        "tests/kernels/test_a.py::test_x[1] PASSED    [  1%]\n"
        "tests/kernels/test_a.py::test_y FAILED    [  2%]\n"
        "tests/kernels/test_b.py::test_z SKIPPED (no fp8 tensor cores)    [  3%]\n"
    )
    counts = counts_from_output(output)
    assert (counts["tests"], counts["failures"], counts["skipped"]) == (3, 1, 1)
    assert counts["failed_tests"] == ["tests/kernels/test_a.py::test_y FAILED    [  2%]"]


def test_a_group_runs_side_by_side_and_the_report_is_written_after_each_group(gpu_check, tmp_path, monkeypatch):
    events: list[str] = []

    def start(name, budget_s, work_dir, dry_run, env):
        events.append(f"start {name}")
        return {"name": name}

    def finish(running):
        events.append(f"finish {running['name']}")
        return {"name": running["name"], "status": "pass", "wall_s": 1.0, "summary": ["ok"]}

    monkeypatch.setattr(gpu_check, "start_section", start)
    monkeypatch.setattr(gpu_check, "finish_section", finish)
    monkeypatch.setattr(gpu_check, "environment", lambda: {"gpus": [], "python": "3", "machine": "x", "packages": {}})
    written = []
    real_write = gpu_check.write_report
    monkeypatch.setattr(
        gpu_check,
        "write_report",
        lambda report, out: written.append(len(report["sections"])) or real_write(report, out),
    )
    gpu_check.main(["--only", "kernel_tests+correctness,memory", "--out", str(tmp_path)])
    assert events == ["start kernel_tests", "start correctness", "finish kernel_tests", "finish correctness",
                      "start memory", "finish memory"]  # fmt: skip
    assert written[:2] == [2, 3]  # after each group, before the final report
    assert "## memory: PASS" in (tmp_path / "gpu_check.md").read_text()
