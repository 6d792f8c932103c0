"""Helpers every tokenmill process uses: logging set-up, dying with the parent, and ZMQ socket creation."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import zmq

from tokenmill.logs import LOG_FORMAT_ENV, log_formatter

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def setup_logging(name: str, level: int = logging.INFO, log_format: str | None = None) -> logging.Logger:
    """Log to stderr as text or JSON lines (tokenmill/logs.py). `log_format` None: the one this process inherited
    (LOG_FORMAT_ENV, text by default); a format given is exported there, so processes started later log alike."""
    if log_format is None:
        log_format = os.environ.get(LOG_FORMAT_ENV, "text")
    os.environ[LOG_FORMAT_ENV] = log_format
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter(name, log_format))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    return logging.getLogger(f"tokenmill.{name}")


def become_child_process(name: str) -> logging.Logger:
    """Set up a scheduler/worker process: it dies when its parent dies, and leaves SIGINT to the parent.

    The parent (the launcher) decides when children stop, by a Shutdown message or SIGTERM; a Ctrl-C in the terminal
    reaches the whole process group, so children ignore SIGINT and let the parent drive an orderly stop.
    SIGTERM keeps its default action (the kernel ends the process) rather than a Python handler: the kernel may hand
    the signal to any thread (gloo, ZMQ and torch start several), and a handler that runs only in the main thread
    would then wait until that thread's blocking ZMQ receive returns, which on an idle worker is never.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_NAME, f"tm-{name}".encode()[:15])  # what ps/top and /proc/PID/comm show
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return setup_logging(name)


def worker_socket_address(config, name: str) -> str:
    """The scheduler's `plans` or `results` socket: TCP when workers run on other nodes (Ray), else ipc://."""
    return config.parallel.worker_addresses.get(name) or config.ipc_address(name)


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind in (zmq.PUSH, zmq.PUB):
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow peer: queues are bounded by the scheduler
    if kind in (zmq.PULL, zmq.SUB):
        sock.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock
