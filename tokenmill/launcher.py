"""Start, watch and stop an instance's engine processes (one scheduler, one worker per rank: pipeline stages x
tensor-parallel ranks).

With `distributed_executor_backend="ray"` the workers are Ray actors (tokenmill/ray_executor.py, imported only then)
and only the scheduler is a child process here; supervision and stopping cover both.

The launcher makes a private socket directory per instance (mode 0700, unique name), so two instances on one host
never collide, starts the children with the config as msgpack bytes, and offers `dead_child()` for supervision: the
serving loop polls it and, when a child has died, fails in-flight requests, reports 503, and shuts the rest down.

Children are fresh interpreters (`python -c CHILD_ENTRY`) that read the parent's sys.path and the config from a pipe,
not multiprocessing processes: multiprocessing's spawn and forkserver both re-run the user's main module in the child,
so `LLM(...)` at the top level of a script without `if __name__ == "__main__":` would start children that start
children. fork is no option either: the parent may hold CUDA state, torch and ZMQ threads, which a forked child
inherits broken. Nothing here is pickled, as everywhere else.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping

from tokenmill.config import EngineConfig, is_pooling_task, replace
from tokenmill.logs import LOG_FORMAT_ENV
from tokenmill.messages import EngineReady
from tokenmill.scheduler.process import run_scheduler_process
from tokenmill.stack_dumps import process_state
from tokenmill.workers.process import run_worker_process

log = logging.getLogger("tokenmill.launcher")

# What a child runs: the parent's import path first (so it imports this same tokenmill), then its role's entry point.
CHILD_ENTRY = (
    "import json, sys; sys.path[:] = json.loads(sys.stdin.buffer.readline()); "
    "from tokenmill.launcher import run_child; run_child(sys.argv[1], sys.stdin.buffer.read())"
)


# libgomp's spin at a barrier before its threads sleep, in spins (about 100 per microsecond): ~0.1 ms
OPENMP_SPIN_COUNT = "10000"
# torch's CPU allocator: when "1", allocations of 2 MiB or more are 2 MiB-aligned and madvise(MADV_HUGEPAGE)d before
# first touch (transparent huge pages where the host's setting is `madvise` or `always`). A batch-1 decode step
# streams the whole model's weights and KV cache, ~100 MB for the default model: in 4 KiB pages a TLB miss every 4 KiB
# the hardware prefetcher cannot cross. On a Zen 4 core (loaded host, alternated in one process) a 92 MiB read peaked
# at 43-44 GB/s in huge pages against 41 in 4 KiB ones, and decode attention over SmolLM2's 30 layers' 256-token
# caches ran ~10% faster. A user's own setting (0 turns it off) wins.
TORCH_HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
# how long a SIGKILLed child may take to go: a worker's exit unmaps its weights and KV cache, which on a host loaded
# far past its cores can outlast the one second once allowed here ("did not exit after SIGKILL" at load 12-18)
KILL_WAIT_S = 5.0


def child_environment(base: Mapping[str, str], log_format: str) -> dict[str, str]:
    """The environment of the scheduler and worker children: `base`, the instance's log format (a child sets up
    logging before it has read the config), and a short OpenMP spin unless the user chose a wait policy or a spin
    count. Between a step's ~300 kernel calls the gaps are microseconds: threads that sleep at once pay a wake-up per
    parallel region, those that spin libgomp's default 3 ms hold a core the scheduler and the frontend need between
    steps. On an idle 2-vCPU host, two threads spinning ~0.1 ms served batch-1 decode at 4.8 ms per token against 7.5
    ms on one thread and 12.9 ms on two passive ones, and 303 against 188 and 144 tok/s at concurrency 16
    (docs/benchmarks.md, "Two compute threads"). On a host already oversubscribed by other work, spinning of any
    length is a cliff: set OMP_WAIT_POLICY=PASSIVE or OMP_NUM_THREADS=1 there (README, "CPU").
    Large tensors go in transparent huge pages unless the user set `TORCH_HUGE_PAGES_ENV` (see there)."""
    env = {**base, LOG_FORMAT_ENV: log_format}
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    env.setdefault(TORCH_HUGE_PAGES_ENV, "1")
    return env


def run_child(role: str, config_bytes: bytes) -> None:
    """Entry point of a child: `scheduler` or `worker<rank>`."""
    if role == "scheduler":
        run_scheduler_process(config_bytes)
    else:
        run_worker_process(config_bytes, int(role.removeprefix("worker")))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcesses:
    """The scheduler and worker processes of one instance."""

    def __init__(self, config: EngineConfig) -> None:
        check_parallel_config(config)
        parallel = config.parallel
        self.ray_workers = None  # the Ray actors, with distributed_executor_backend "ray"
        if parallel.distributed_executor_backend == "ray":
            from tokenmill.ray_executor import RayWorkers

            self.ray_workers = RayWorkers(config)  # placed now: the rendezvous and socket addresses come from it
            parallel = self.ray_workers.parallel
        elif parallel.world_size > 1 and not parallel.dist_port:
            parallel = replace(parallel, dist_port=free_port())
        ipc_dir = tempfile.mkdtemp(prefix="tokenmill-")  # mkdtemp: unique name, mode 0700
        self.config = replace(config, ipc_dir=ipc_dir, parallel=parallel)
        self.children: list[tuple[str, subprocess.Popen]] = []  # (name, process)
        self.stopped = False
        self.env: dict[str, str] | None = None  # the children's environment (None: this process's); DP replicas set it

    def start(self) -> EngineProcesses:
        local_workers = 0 if self.ray_workers is not None else self.config.parallel.world_size
        roles = ["scheduler"] + [f"worker{rank}" for rank in range(local_workers)]
        preamble = json.dumps([str(entry) for entry in sys.path]).encode() + b"\n"
        # each child gets only what it needs: no API key, no scheduler's CURVE secret for the workers
        config_bytes = {
            "scheduler": self.config.for_scheduler().to_bytes(),
            "worker": self.config.for_workers().to_bytes(),
        }
        env = child_environment(self.env if self.env is not None else os.environ, self.config.server.log_format)
        for role in roles:
            child = subprocess.Popen([sys.executable, "-c", CHILD_ENTRY, role], stdin=subprocess.PIPE, env=env)
            self.children.append((f"tokenmill-{role}", child))
            try:
                child.stdin.write(preamble + config_bytes["scheduler" if role == "scheduler" else "worker"])
                child.stdin.close()
            except BrokenPipeError:
                pass  # it has already exited: dead_child() reports it
        if self.ray_workers is not None:
            self.ray_workers.start(self.config)
        return self

    def dead_child(self) -> str | None:
        """A sentence naming every child that has exited, or None while all are alive.

        Naming them all shows the cause when one death brings on another (a killed rank makes rank 0's all-reduce
        fail, and the scheduler exits on rank 0's error).
        """
        dead = [
            f"{name} (pid {child.pid}) exited with code {child.returncode}"
            for name, child in self.children
            if child.poll() is not None
        ]
        if self.ray_workers is not None and not self.stopped:
            dead += self.ray_workers.dead()
        return "; ".join(dead) or None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every child (SIGTERM, then SIGKILL after `timeout`) and remove the socket directory. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        for _, child in self.children:
            if child.poll() is None:
                child.terminate()
                child.send_signal(signal.SIGCONT)  # a stopped child (SIGSTOP, a hung-worker test) acts on it at once
        deadline = time.monotonic() + timeout
        survivors = [(name, child) for name, child in self.children if not exited_by(child, deadline)]
        kill_and_reap(survivors)
        if self.ray_workers is not None:
            self.ray_workers.stop()
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)


def exited_by(child: subprocess.Popen, deadline: float) -> bool:
    """Wait for `child` until `deadline` (time.monotonic()); whether it exited (and was reaped)."""
    try:
        child.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return True


def kill_and_reap(children: list[tuple[str, subprocess.Popen]], wait_s: float = KILL_WAIT_S) -> None:
    """SIGKILL every (name, child) and wait up to `wait_s` for them all. One still there is logged with what the
    kernel says it does (`process_state`: uninterruptible sleep, or an address space of gigabytes still being torn
    down on an oversubscribed host) and left to a daemon thread that reaps it when it exits: never a zombie."""
    for _, child in children:
        child.kill()
    deadline = time.monotonic() + wait_s
    for name, child in children:
        if exited_by(child, deadline):
            continue
        log.error(
            "%s (pid %d) has not exited %g s after SIGKILL (%s); reaping it in the background",
            name,
            child.pid,
            wait_s,
            process_state(child.pid),
        )
        threading.Thread(target=child.wait, name=f"reap-{name}", daemon=True).start()


def check_parallel_config(config: EngineConfig) -> None:
    """ValueError naming the field when the parallel sizes cannot work."""
    parallel = config.parallel
    for field in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(parallel, field) < 1:
            raise ValueError(f"{field} must be at least 1, got {getattr(parallel, field)}")
    if parallel.pipeline_parallel_size > 1 and is_pooling_task(config.model.task):
        raise ValueError("pipeline_parallel_size > 1 serves generation models only (pooling tasks run unsplit)")


def kv_capacity_error(config: EngineConfig, ready: EngineReady) -> str | None:
    """Why the instance must not start: its KV budget cannot hold one request of max_model_len (vLLM's check).

    An explicit block count (--num-gpu-blocks-override, num_kv_blocks=...) is taken as asked, as in vLLM: then
    `log_capacity` only warns and a request ends with "length" when it fills the whole cache.
    """
    tokens = ready.num_kv_blocks * ready.block_size
    max_len = config.model.max_model_len
    if is_pooling_task(config.model.task) or config.cache.num_kv_blocks or max_len <= tokens:
        return None
    return (
        f"max_model_len {max_len} needs {-(-max_len // ready.block_size)} KV cache blocks but only "
        f"{ready.num_kv_blocks} of {ready.block_size} tokens fit (raise --kv-cache-memory-bytes on CPU or "
        f"--gpu-memory-utilization on GPU, or lower --max-model-len): the largest max_model_len that fits "
        f"is {tokens}."
    )


def log_capacity(config: EngineConfig, ready: EngineReady) -> None:
    tokens = ready.num_kv_blocks * ready.block_size
    max_len = config.model.max_model_len
    log.info(
        "model %s (%s), architecture %s, dtype %s, device %s, weights %.1f MiB",
        config.model.served_model_name,
        config.model.path,
        ready.architecture,
        ready.dtype,
        ready.device,
        ready.weight_bytes / 2**20,
    )
    if is_pooling_task(config.model.task):
        log.info(
            "no KV cache (embeddings: each step encodes whole inputs, up to %d tokens)",
            config.scheduler.max_num_batched_tokens,
        )
    else:
        kv_dtype = ready.dtype if config.cache.kv_cache_dtype == "auto" else config.cache.kv_cache_dtype
        log.info(
            "KV cache (%s): %d blocks of %d tokens = %d tokens; maximum concurrency at max_model_len %d: %.2fx",
            kv_dtype,
            ready.num_kv_blocks,
            ready.block_size,
            tokens,
            max_len,
            tokens / max_len,
        )
        if tokens < max_len and config.cache.num_kv_blocks:  # a budget this small refuses to start instead
            log.warning(
                "the KV cache (%d tokens) cannot hold one request of max_model_len %d: a request ends with "
                "finish_reason 'length' when it fills the whole cache",
                tokens,
                max_len,
            )
    if os.environ.get("TOKENMILL_LOG_IPC"):
        log.info("sockets in %s", config.ipc_dir)
