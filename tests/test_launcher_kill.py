"""The launcher's last resort: children SIGKILLed when they ignore SIGTERM, each reaped (no zombie left), and one
that outlives SIGKILL logged with its kernel state and reaped in the background once it goes."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tokenmill.launcher import kill_and_reap
from tokenmill.stack_dumps import process_state

IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
)


def test_children_that_ignore_sigterm_are_killed_and_reaped():
    children = [
        (f"child{i}", subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE))
        for i in range(2)
    ]
    for _, child in children:
        assert child.stdout is not None and child.stdout.readline()  # its handler is in place
        child.terminate()
    time.sleep(0.2)
    assert all(child.poll() is None for _, child in children)
    kill_and_reap(children)
    assert [child.returncode for _, child in children] == [-signal.SIGKILL] * 2
    assert not any(Path(f"/proc/{child.pid}").exists() for _, child in children), "a zombie was left"


class SlowToDieChild:
    """A child whose exit outlasts SIGKILL (as one in uninterruptible sleep): its timed waits expire; the reaper's
    untimed wait is recorded. Its pid is a real sleeping process, so /proc has a state to report."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.killed = False
        self.reaped = threading.Event()

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float | None = None) -> int:
        if timeout is not None:
            time.sleep(timeout)
            raise subprocess.TimeoutExpired("slow-to-die", timeout)
        self.reaped.set()
        return -signal.SIGKILL


def test_a_child_that_outlives_sigkill_is_logged_with_its_state_and_reaped_later(caplog):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.2)
        assert process_state(sleeper.pid).startswith("state S (sleeping)")
        slow = SlowToDieChild(sleeper.pid)
        with caplog.at_level(logging.ERROR, logger="tokenmill.launcher"):
            started = time.monotonic()
            kill_and_reap([("tokenmill-worker0", slow)], wait_s=0.3)  # type: ignore[list-item]
        assert time.monotonic() - started < 5, "the stop waits a bounded time"
        assert slow.killed and slow.reaped.wait(5), "no thread went on waiting for it: it would stay a zombie"
        assert f"tokenmill-worker0 (pid {sleeper.pid}) has not exited 0.3 s after SIGKILL" in caplog.text
        assert "state S (sleeping)" in caplog.text
    finally:
        sleeper.kill()
        sleeper.wait()
    assert process_state(sleeper.pid) == "no /proc entry"
