"""tokenmill installs as one namespace: the top-level folders become `tokenmill.frontend`, `tokenmill.scheduler`,
`tokenmill.workers` and `tokenmill.kernels`, and nothing else lands in site-packages."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GENERIC_NAMES = ("frontend", "scheduler", "workers", "kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("tokenmill-*.whl")
    return built


def test_the_wheel_holds_only_the_tokenmill_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"tokenmill", wheel.name.split("-py3")[0] + ".dist-info"}
    for subpackage in GENERIC_NAMES:
        assert f"tokenmill/{subpackage}/__init__.py" in names
    assert "tokenmill/workers/models/llama.py" in names
    assert "tokenmill/workers/lora/manager.py" in names  # a subpackage pyproject must list
    assert "tokenmill/frontend/tool_parsers/hermes.py" in names
    assert "tokenmill/kernels/cpu_ops.cpp" in names  # compiled on first use, so it must ship
    assert "tokenmill/frontend/static/dashboard.html" in names  # the page /dashboard serves


@pytest.mark.slow
def test_installed_wheel_imports_as_tokenmill_and_not_as_generic_names(wheel, tmp_path):
    """A venv that sees this environment's dependencies (not the source tree) with the wheel installed."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = f"""
import importlib, importlib.util, sys
import tokenmill.scheduler, tokenmill.workers, tokenmill.frontend, tokenmill.kernels
from tokenmill.scheduler.scheduler import Scheduler
assert tokenmill.__file__.startswith({str(env_dir)!r}), tokenmill.__file__
for name in {GENERIC_NAMES!r}:
    spec = importlib.util.find_spec(name)
    # nothing of ours answers to the generic name (another library may own `kernels`: Hugging Face's does)
    assert spec is None or not spec.origin.startswith({str(env_dir)!r}), (name, spec)
    if name != "kernels":
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        else:
            raise AssertionError("import " + name + " worked")
print("ok")
"""
    result = subprocess.run([str(python), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
