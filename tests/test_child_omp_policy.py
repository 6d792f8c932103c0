"""The engine's children start with OpenMP threads that sleep when idle (no spinning against the scheduler and the
frontend on a small CPU host), unless the user chose a wait policy."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tokenmill import launcher
from tokenmill.config import EngineConfig


class FakeChild:
    def __init__(self, args: list[str], env: dict[str, str], **kwargs) -> None:
        self.env = env
        self.stdin = _Sink()
        self.pid, self.returncode = 0, None

    def poll(self):
        return None


class _Sink:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def started_children_envs(monkeypatch) -> list[dict[str, str]]:
    children: list[FakeChild] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: children.append(FakeChild(*a, **k)) or children[-1])
    processes = launcher.EngineProcesses(EngineConfig())
    try:
        processes.start()
    finally:
        processes.stopped = True  # nothing real to stop
        shutil.rmtree(processes.config.ipc_dir, ignore_errors=True)
    return [child.env for child in children]


def test_children_default_to_a_passive_openmp_wait_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    envs = started_children_envs(monkeypatch)
    assert envs and all(env["OMP_WAIT_POLICY"] == "PASSIVE" for env in envs)


@pytest.mark.parametrize("policy", ["ACTIVE", "passive"])
def test_a_users_wait_policy_wins(monkeypatch, policy):
    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    assert all(env["OMP_WAIT_POLICY"] == policy for env in started_children_envs(monkeypatch))
