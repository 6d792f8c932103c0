"""Helpers every tokenmill process uses: logging set-up, dying with the parent, and ZMQ socket creation."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import TypeVar

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.logs import LOG_FORMAT_ENV, log_formatter
from tokenmill.socket_security import max_message_bytes, secure_socket
from tokenmill.stack_dumps import enable_stack_dumps

T = TypeVar("T")

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
    """Set up a scheduler/worker process: it dies when its parent dies, leaves SIGINT to the parent, and writes its
    threads' Python stacks to its log on SIGUSR1 (tokenmill/stack_dumps.py).

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
    enable_stack_dumps()  # SIGUSR1: every thread's Python stack to the log (a hung worker says where it was)
    return setup_logging(name)


def worker_socket_address(config: EngineConfig, name: str) -> str:
    """The scheduler's `plans` or `results` socket: TCP when workers run on other nodes (Ray), else ipc://."""
    return config.parallel.worker_addresses.get(name) or config.ipc_address(name)


def worker_socket(ctx: zmq.Context, config: EngineConfig, name: str, kind: int, bind: bool) -> zmq.Socket:
    """The scheduler's (bind) or a worker's (connect) end of the `plans` or `results` socket: over ipc:// a plain
    socket, over tcp:// a CURVE one with bounded queues and frames (tokenmill/socket_security.py)."""
    address = worker_socket_address(config, name)
    if address.startswith("ipc://"):
        return make_socket(ctx, kind, address, bind)
    keys = config.parallel.worker_socket_keys
    if keys is None:
        raise ValueError(f"the {name} socket leaves the host ({address}) but the config has no worker_socket_keys")
    return secure_socket(ctx, kind, address, bind, keys, max_message_bytes(config))


def decode_or_drop(
    decoder: msgspec.msgpack.Decoder[T], frame: bytes, log: logging.Logger | logging.LoggerAdapter, source: str
) -> T | None:
    """The message in `frame`, or None (logged, never raised) when it does not decode: one bad frame from a peer
    must not end the process that reads it."""
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.error("dropped an undecodable %d-byte frame from %s: %s", len(frame), source, str(exc)[:200])
        return None


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    """A socket on the instance's private ipc:// directory, where only its own processes can connect: unbounded
    queues (the scheduler bounds what it sends) and frames."""
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
