"""Where a hung process was: every engine child prints its threads' Python stacks to its log on SIGUSR1.

A worker that stops answering is declared dead by the scheduler's watchdog (`--worker-step-timeout`) and the
instance shuts down; without more, nothing says where the worker was. So each child registers `faulthandler` for
SIGUSR1 at start (`enable_stack_dumps`), and the scheduler, before it gives up on a local worker, sends it SIGUSR1
and waits a moment (`ask_for_stacks`) so the stacks reach the log before the launcher kills the process.

faulthandler writes from its C signal handler, not from Python code in the main thread: the stacks come out while
the main thread is blocked in a kernel call, a ZMQ receive or an OpenMP barrier, which is where a hung worker sits.
An operator can ask any child for the same at any time: `kill -USR1 <pid>`. A process stopped with SIGSTOP, or in
uninterruptible sleep, answers only when it runs again.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

STACK_DUMP_SIGNAL = signal.SIGUSR1
# how long the asker waits for the dumps: faulthandler writes at once, but a loaded host may not run the process
# for a while
STACK_DUMP_WAIT_S = 1.0


def enable_stack_dumps() -> None:
    """On SIGUSR1, write every thread's Python stack to stderr (the process's log). Call once, early."""
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def ask_for_stacks(
    processes: Sequence[tuple[str, int]], log: logging.Logger, wait_s: float = STACK_DUMP_WAIT_S
) -> None:
    """Send SIGUSR1 to each (name, pid) that still runs, then wait `wait_s` for them to write their stacks. The log
    line gives each one's kernel state: one in uninterruptible sleep writes nothing until the kernel lets it go."""
    asked = []
    for name, pid in processes:
        state = process_state(pid)  # before the signal wakes it
        try:
            os.kill(pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            continue  # already gone: nothing to dump
        asked.append(f"{name} (pid {pid}, {state})")
    if asked:
        log.error("asked %s for their Python stacks (SIGUSR1): they follow in the log", ", ".join(asked))
        time.sleep(wait_s)


def process_state(pid: int) -> str:
    """What the kernel says `pid` is doing: its state (R running, S sleeping, D uninterruptible sleep, T stopped, Z
    zombie) and, while it sleeps, the kernel function it waits in. A process in D answers no signal, SIGKILL
    included, until the kernel call returns: that, and not Python, is then where it hangs."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "no /proc entry"
    state = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")), "?")
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        wchan = ""
    return f"state {state}" + (f", waiting in {wchan}" if wchan not in ("", "0") else "")
