"""Every kernel compiles to a cubin for sm_80 and sm_90, the fp8 KV-cache variants for sm_90 (no GPU needed; see
cuda_compile_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")


def test_kernels_compile_for_nvidia_targets():
    script = Path(__file__).with_name("cuda_compile_check.py")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(script), "80", "90"], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = [line for line in result.stdout.splitlines() if ": ok," in line]
    # 18 configs a target (6 of them split-KV decode); on sm_90 6 more with fp8 KV caches and the W8A8 fp8 GEMM
    assert len(compiled) == 36 + 7, result.stdout
