"""The engine's children allocate their large tensors (weights, KV cache) in transparent huge pages unless the user
chose otherwise: torch's allocator does it when THP_MEM_ALLOC_ENABLE=1 is in its environment."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import launcher

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_children_ask_torch_for_huge_pages_by_default(monkeypatch):
    monkeypatch.delenv(launcher.TORCH_HUGE_PAGES_ENV, raising=False)
    env = launcher.child_environment({}, "text")
    assert env[launcher.TORCH_HUGE_PAGES_ENV] == "1"


def test_a_users_choice_wins():
    env = launcher.child_environment({launcher.TORCH_HUGE_PAGES_ENV: "0"}, "text")
    assert env[launcher.TORCH_HUGE_PAGES_ENV] == "0"


def huge_pages_of_a_64_mib_tensor(env: dict[str, str]) -> int:
    """AnonHugePages (KiB) of a child process that allocated and touched a 64 MiB torch tensor."""
    script = (
        "import torch; x = torch.ones(64 << 20, dtype=torch.uint8); "
        "print(next(l for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')))"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    match = re.search(r"AnonHugePages:\s+(\d+) kB", out)
    assert match, out
    return int(match.group(1))


@pytest.mark.skipif(
    not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(), reason="the host has no transparent huge pages"
)
def test_torch_honours_the_variable_the_children_get():
    base = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    assert huge_pages_of_a_64_mib_tensor(launcher.child_environment(base, "text")) >= 32 << 10
    assert huge_pages_of_a_64_mib_tensor({**base, launcher.TORCH_HUGE_PAGES_ENV: "0"}) == 0
