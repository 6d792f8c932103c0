"""Data parallelism on one host: N engine replicas, each a scheduler with its workers, its own KV cache and prefix
cache, and its own private socket directory, behind one frontend (`--data-parallel-size N`).

`DataParallelEngines` starts and stops the replicas' processes (one `EngineProcesses` each) and offers the same
interface as one `EngineProcesses`, so the offline `LLM` and `tokenmill serve` drive one or N alike. Each replica's
processes learn their replica index (`parallel.data_parallel_rank`, which labels their step summaries); on CUDA each
replica sees its own GPUs (CUDA_VISIBLE_DEVICES sliced per replica, as vLLM does), and on CPU the host's cores are
split between the replicas (OMP_NUM_THREADS) unless the user set it.

`EngineSockets` is the offline client's (blocking) link to the replicas: it routes each request with the frontend's
router (`frontend/router.py`), sends aborts to the replica that owns the request, and reads every replica's outputs.
The server's asynchronous counterpart is `frontend/data_parallel_client.py`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import zmq

from tokenmill.config import EngineConfig, replace
from tokenmill.frontend.router import Router
from tokenmill.launcher import EngineProcesses
from tokenmill.messages import (
    AbortRequest,
    EngineRequest,
    SchedulerMessage,
    StepOutputs,
    choice_requests,
    decoder,
    encode,
)
from tokenmill.processes import decode_or_drop, make_socket

log = logging.getLogger("tokenmill.data_parallel")


def check_data_parallel(config: EngineConfig) -> None:
    parallel = config.parallel
    if parallel.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {parallel.data_parallel_size}")


def replica_environments(config: EngineConfig, environ: dict[str, str] | None = None) -> list[dict[str, str] | None]:
    """Each replica's child environment: None (inherit) with one replica; else its slice of the GPUs and of the
    CPU threads."""
    size = config.parallel.data_parallel_size
    if size == 1:
        return [None] * size
    environ = dict(os.environ if environ is None else environ)
    per_replica = config.parallel.world_size
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = (
        [d for d in visible.split(",") if d.strip()]
        if visible is not None
        else [str(i) for i in range(size * per_replica)]
    )
    # Ray assigns its actors' GPUs itself; an empty CUDA_VISIBLE_DEVICES (no GPU) stays empty
    local_gpus = config.parallel.distributed_executor_backend == "mp" and bool(devices)
    if local_gpus and config.parallel.device == "cuda" and len(devices) < size * per_replica:
        raise ValueError(
            f"data_parallel_size {size} x {per_replica} worker ranks per replica needs "
            f"{size * per_replica} GPUs; CUDA_VISIBLE_DEVICES names {len(devices)}"
        )
    threads = max(1, (os.cpu_count() or 1) // size)
    envs = []
    for rank in range(size):
        env = dict(environ)
        if local_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[rank * per_replica : (rank + 1) * per_replica])
        env.setdefault("OMP_NUM_THREADS", str(threads))
        envs.append(env)
    return envs


class DataParallelEngines:
    """The processes of every replica; `config` is replica 0's (its socket directory), `replicas[i].config` each."""

    def __init__(self, config: EngineConfig) -> None:
        check_data_parallel(config)
        envs = replica_environments(config)
        self.replicas: list[EngineProcesses] = []
        for rank, env in enumerate(envs):
            replica = EngineProcesses(replace(config, parallel=replace(config.parallel, data_parallel_rank=rank)))
            replica.env = env
            self.replicas.append(replica)
        self.config = self.replicas[0].config

    @property
    def size(self) -> int:
        return len(self.replicas)

    @property
    def stopped(self) -> bool:
        return all(replica.stopped for replica in self.replicas)

    @property
    def children(self) -> list:
        """(name, process) of every replica's scheduler and workers."""
        return [child for replica in self.replicas for child in replica.children]

    @property
    def configs(self) -> list[EngineConfig]:
        return [replica.config for replica in self.replicas]

    def start(self) -> DataParallelEngines:
        for replica in self.replicas:
            replica.start()
        return self

    def dead_child(self) -> str | None:
        """Every exited child of every replica, or None while all are alive."""
        dead = [
            f"replica {rank}: {reason}" if self.size > 1 else reason
            for rank, replica in enumerate(self.replicas)
            if (reason := replica.dead_child()) is not None
        ]
        return "; ".join(dead) or None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every replica (their children are signalled together, then waited for). Idempotent."""
        for replica in self.replicas:
            for _, child in replica.children:
                if child.poll() is None:
                    child.terminate()
        for replica in self.replicas:
            replica.stop(timeout)


class EngineSockets:
    """Blocking sockets to every replica's scheduler: requests routed, aborts to their owner, outputs from all.

    Requests count as in flight on their replica (the router's load) until their output finishes or they are
    aborted."""

    def __init__(self, ctx: zmq.Context, configs: Sequence[EngineConfig]) -> None:
        parallel = configs[0].parallel
        self.to_schedulers = [make_socket(ctx, zmq.PUSH, c.ipc_address("requests"), bind=False) for c in configs]
        self.from_schedulers = [make_socket(ctx, zmq.PULL, c.ipc_address("outputs"), bind=False) for c in configs]
        self.router = Router(len(configs), configs[0].cache.block_size, parallel.data_parallel_routing)
        self.owner: dict[str, int] = {}  # request id of each choice in flight -> its replica
        self._decoder = decoder(SchedulerMessage)
        self._poller = zmq.Poller()
        self._next = 0  # the replica whose socket is read first next time
        for sock in self.from_schedulers:
            self._poller.register(sock, zmq.POLLIN)

    @property
    def size(self) -> int:
        return len(self.to_schedulers)

    def send_request(self, request: EngineRequest) -> int:
        """Send a request (all of its choices) to the replica the router picks; returns the replica."""
        replica = 0
        if self.size > 1:
            replica = self.router.route(request.prompt_token_ids, request.cache_salt, request.sampling.n)
            for choice in choice_requests(request):
                self.owner[choice.request_id] = replica
        self.to_schedulers[replica].send(encode(request))
        return replica

    def send_abort(self, request_ids: Sequence[str]) -> None:
        if self.size == 1:
            self.to_schedulers[0].send(encode(AbortRequest(list(request_ids))))
            return
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            replica = self.owner.pop(request_id, None)
            if replica is not None:
                by_replica.setdefault(replica, []).append(request_id)
                self.router.release(replica)
        for replica, ids in by_replica.items():
            self.to_schedulers[replica].send(encode(AbortRequest(ids)))

    def broadcast(self, message) -> None:
        payload = encode(message)
        for sock in self.to_schedulers:
            sock.send(payload)

    def receive(self, timeout_ms: int):
        """The next message from any replica (taken in turn, so none starves), or None after `timeout_ms`."""
        msg = self._take()
        if msg is None and self._poller.poll(timeout_ms):
            msg = self._take()
        return msg

    def _take(self):
        for _ in range(self.size):
            replica = self._next
            self._next = (self._next + 1) % self.size
            try:
                raw = self.from_schedulers[replica].recv(zmq.NOBLOCK)
            except zmq.Again:
                continue
            # an undecodable frame is logged and dropped, as the scheduler and the server's client do
            msg = decode_or_drop(self._decoder, raw, log, f"replica {replica}'s scheduler")
            if msg is not None:
                return self._noted(replica, msg)
        return None

    def _noted(self, replica: int, msg):
        """`msg`, after the router has noted what it says about the replica (finished requests, KV usage)."""
        if self.size > 1 and isinstance(msg, StepOutputs):
            for out in msg.outputs:
                if out.finish_reason is not None and self.owner.pop(out.request_id, None) is not None:
                    self.router.release(replica)
            if msg.stats is not None:
                self.router.kv_usage[replica] = msg.stats.kv_cache_usage
        return msg
