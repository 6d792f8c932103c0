"""Start a real `tokenmill serve` in a subprocess for end-to-end tests, and find what it left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process below pid (children, grandchildren, ...), from /proc."""
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except OSError:
                continue
            found.extend(kids)
            frontier.extend(kids)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    """`with Server(model_args) as s:` starts tokenmill, waits for /health 200 and stops it (SIGTERM) on exit."""

    def __init__(self, *args: str, log_path: Path | None = None, env: dict | None = None, startup_timeout: float = 180):
        self.port = free_port()
        self.args = [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting: {self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server did not become healthy: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path and self.log_path.exists() else ""

    def children(self) -> list[int]:
        return descendants(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        kids = self.children() if self.proc.poll() is None else []
        self.stop()
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def child_by_role(server: Server, role: str) -> int:
    """pid of the child named tm-<role> (children set their process name at start-up)."""
    for pid in server.children():
        try:
            if open(f"/proc/{pid}/comm").read().strip() == f"tm-{role}":
                return pid
        except OSError:
            continue
    raise AssertionError(f"no tm-{role} process among {server.children()}")
