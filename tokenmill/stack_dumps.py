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
    """Send SIGUSR1 to each (name, pid) that still runs, then wait `wait_s` for them to write their stacks."""
    asked = []
    for name, pid in processes:
        try:
            os.kill(pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            continue  # already gone: nothing to dump
        asked.append(f"{name} (pid {pid})")
    if asked:
        log.error("asked %s for their Python stacks (SIGUSR1): they follow in the log", ", ".join(asked))
        time.sleep(wait_s)
