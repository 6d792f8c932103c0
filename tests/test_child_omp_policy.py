"""The engine's children start with OpenMP threads that spin briefly at a barrier (about 0.1 ms: hot through a step's
kernel calls, asleep between steps, where the scheduler and the frontend need the cores), unless the user chose a wait
policy or a spin count."""

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


def test_children_spin_briefly_by_default(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    envs = started_children_envs(monkeypatch)
    assert envs and all(
        env["GOMP_SPINCOUNT"] == launcher.OPENMP_SPIN_COUNT and "OMP_WAIT_POLICY" not in env for env in envs
    )


@pytest.mark.parametrize("policy", ["ACTIVE", "passive"])
def test_a_users_wait_policy_wins(monkeypatch, policy):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    envs = started_children_envs(monkeypatch)
    assert envs and all(env["OMP_WAIT_POLICY"] == policy and "GOMP_SPINCOUNT" not in env for env in envs)


def test_a_users_spin_count_wins(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    envs = started_children_envs(monkeypatch)
    assert envs and all(env["GOMP_SPINCOUNT"] == "300000" for env in envs)
