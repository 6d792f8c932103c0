"""Start, watch and stop an instance's engine processes (one scheduler, one worker per tensor-parallel rank).

The launcher makes a private socket directory per instance (mode 0700, unique name), so two instances on one host
never collide, spawns the children with the config as msgpack bytes, and offers `dead_child()` for supervision: the
serving loop polls it and, when a child has died, fails in-flight requests, reports 503, and shuts the rest down.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time

from tokenmill.scheduler.process import run_scheduler_process
from tokenmill.config import EngineConfig, replace
from tokenmill.messages import EngineReady
from tokenmill.workers.process import run_worker_process

log = logging.getLogger("tokenmill.launcher")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcesses:
    """The scheduler and worker processes of one instance."""

    def __init__(self, config: EngineConfig) -> None:
        ipc_dir = tempfile.mkdtemp(prefix="tokenmill-")  # mkdtemp: unique name, mode 0700
        parallel = config.parallel
        if parallel.tensor_parallel_size > 1 and not parallel.dist_port:
            parallel = replace(parallel, dist_port=free_port())
        self.config = replace(config, ipc_dir=ipc_dir, parallel=parallel)
        self.children: list[mp.Process] = []
        self.stopped = False

    def start(self) -> "EngineProcesses":
        ctx = mp.get_context("spawn")
        blob = self.config.to_bytes()
        self.children.append(ctx.Process(target=run_scheduler_process, args=(blob,), name="tokenmill-scheduler"))
        for rank in range(self.config.parallel.tensor_parallel_size):
            self.children.append(ctx.Process(target=run_worker_process, args=(blob, rank), name=f"tokenmill-worker{rank}"))
        for child in self.children:
            child.start()
        return self

    def dead_child(self) -> str | None:
        """A sentence naming every child that has exited, or None while all are alive.

        Naming them all shows the cause when one death brings on another (a killed rank makes rank 0's all-reduce
        fail, and the scheduler exits on rank 0's error).
        """
        dead = [f"{child.name} (pid {child.pid}) exited with code {child.exitcode}"
                for child in self.children if child.exitcode is not None]
        return "; ".join(dead) or None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every child (SIGTERM, then SIGKILL after `timeout`) and remove the socket directory. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        for child in self.children:
            if child.is_alive():
                child.terminate()
        deadline = time.monotonic() + timeout
        for child in self.children:
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()
                child.join(1.0)
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)


def log_capacity(config: EngineConfig, ready: EngineReady) -> None:
    tokens = ready.num_kv_blocks * ready.block_size
    max_len = config.model.max_model_len
    log.info("model %s (%s), architecture %s, dtype %s, device %s, weights %.1f MiB",
             config.model.served_model_name, config.model.path, ready.architecture, ready.dtype, ready.device,
             ready.weight_bytes / 2**20)
    if config.model.task == "embed":
        log.info("no KV cache (embeddings: each step encodes whole inputs, up to %d tokens)",
                 config.scheduler.max_num_batched_tokens)
    else:
        log.info("KV cache: %d blocks of %d tokens = %d tokens; maximum concurrency at max_model_len %d: %.2fx",
                 ready.num_kv_blocks, ready.block_size, tokens, max_len, tokens / max_len)
    if os.environ.get("TOKENMILL_LOG_IPC"):
        log.info("sockets in %s", config.ipc_dir)
