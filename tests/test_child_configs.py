"""What each child receives: the scheduler and the workers (processes or Ray actors) never get the API key, and the
workers never get the scheduler's CURVE secret key."""

from __future__ import annotations

import io
import shutil
import subprocess

import pytest

from tokenmill import launcher
from tokenmill.config import EngineConfig, ParallelConfig, ServerConfig
from tokenmill.ray_executor import RayWorkers
from tokenmill.socket_security import new_worker_socket_keys

API_KEY = "api-key-that-must-stay-home"


@pytest.fixture
def config() -> EngineConfig:
    parallel = ParallelConfig(tensor_parallel_size=2, dist_port=12345, worker_socket_keys=new_worker_socket_keys())
    return EngineConfig(parallel=parallel, server=ServerConfig(api_key=API_KEY))


class FakeChild:
    def __init__(self, args: list[str], **kwargs) -> None:
        self.role = args[-1]
        self.env = kwargs.get("env")
        self.stdin = io.BytesIO()
        self.stdin.close = lambda: None  # keep what was written readable
        self.pid, self.returncode = 0, None

    def poll(self):
        return None


def test_launcher_sends_each_child_only_what_it_needs(config, monkeypatch):
    children: list[FakeChild] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: children.append(FakeChild(*a, **k)) or children[-1])
    processes = launcher.EngineProcesses(config)
    try:
        processes.start()
    finally:
        processes.stopped = True  # nothing real to stop
        shutil.rmtree(processes.config.ipc_dir, ignore_errors=True)
    secret = config.parallel.worker_socket_keys.server_secret.encode()
    sent = {child.role: child.stdin.getvalue().split(b"\n", 1)[1] for child in children}
    assert set(sent) == {"scheduler", "worker0", "worker1"}
    assert all(API_KEY.encode() not in data for data in sent.values())
    assert secret in sent["scheduler"] and secret not in sent["worker0"] + sent["worker1"]
    assert (
        EngineConfig.from_bytes(sent["worker1"]).parallel.worker_socket_keys.client_secret
        == config.parallel.worker_socket_keys.client_secret
    )


def test_ray_actors_get_no_api_key_and_no_scheduler_secret(config):
    calls: list[bytes] = []

    class FakeMethod:
        def remote(self, config_bytes: bytes, rank: int) -> int:
            calls.append(config_bytes)
            return rank

    class FakeActor:
        run = FakeMethod()

    workers = object.__new__(RayWorkers)  # no Ray cluster: only what `start` sends
    workers.actors = [FakeActor(), FakeActor()]
    workers.start(config)
    secret = config.parallel.worker_socket_keys.server_secret.encode()
    assert len(calls) == 2 and all(API_KEY.encode() not in c and secret not in c for c in calls)
