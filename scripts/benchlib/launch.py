"""Start `tokenmill serve` for a benchmark (`--launch`), wait until it is healthy, and stop it afterwards."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    # /ready, not /health: the port opens (and /health may answer) while the weights still load
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def launched_server(serve_args: list[str], log_path: Path) -> Iterator[str]:
    """Run `tokenmill serve *serve_args` on a free local port; yields its base URL; SIGTERM (then SIGKILL) at exit."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not _healthy(url):
                if proc.poll() is not None:
                    raise RuntimeError(f"tokenmill serve exited with code {proc.returncode}; see {log_path}")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"tokenmill serve was not healthy after {STARTUP_TIMEOUT_S:.0f} s; see {log_path}"
                    )
                time.sleep(0.5)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
