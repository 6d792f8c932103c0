"""A worker process that reports ready and then hangs inside its first step, for the hung-worker tests.

Run as `python -m tests.helpers.hanging_worker` with the worker config's bytes on stdin: it sets itself up as the
launcher's workers do (`become_child_process`, so SIGUSR1 dumps its stacks to stderr), reports ready with its pid,
and on the first plan calls `hang_inside_a_step`, which never returns: the stack dump must name it.
"""

from __future__ import annotations

import os
import sys
import time

import zmq

from tokenmill.config import EngineConfig
from tokenmill.messages import WorkerReady, encode
from tokenmill.processes import become_child_process, worker_socket


def hang_inside_a_step() -> None:
    while True:
        time.sleep(3600)


def main() -> None:
    become_child_process("worker0")
    config = EngineConfig.from_bytes(sys.stdin.buffer.read())
    ctx = zmq.Context()
    plans = worker_socket(ctx, config, "plans", zmq.SUB, bind=False)
    results = worker_socket(ctx, config, "results", zmq.PUSH, bind=False)
    time.sleep(0.3)  # PUB/SUB: the subscription reaches the scheduler before its first plan
    ready = WorkerReady(
        rank=0, num_kv_blocks=64, weight_bytes=0, device="cpu", dtype="float32", architecture="fake", pid=os.getpid()
    )
    results.send(encode(ready))
    plans.recv()
    hang_inside_a_step()


if __name__ == "__main__":
    main()
