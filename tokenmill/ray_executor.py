"""`--distributed-executor-backend ray`: the workers of one engine as Ray actors, placed across a Ray cluster's nodes.

The scheduler and the frontend stay where `tokenmill serve` (or `LLM(...)`) runs; only the workers move. One actor
per rank, each in a bundle of a placement group (`{"GPU": 1}` on GPU, `{"CPU": 1}` on CPU; PACK as vLLM's default,
$TOKENMILL_RAY_PLACEMENT_STRATEGY to change it), so the world is reserved whole or not at all. Ranks go to the
actors sorted by node (this node first, then by IP), so a stage's tensor-parallel ranks share a node when they
can. The torch.distributed rendezvous is rank 0's node IP and a port found free there; the scheduler binds its
`plans` and `results` sockets on this node's IP (TCP, CURVE-authenticated with keys made per instance and sent in the
actors' config: tokenmill/socket_security.py) and the actors connect to them, with the same msgspec messages as over
ipc://. Each actor runs the subprocess's entry point (`workers/process.py: serve_worker`) as its one
long-running method; that method's result turning ready means the actor has stopped or died, which is how
supervision notices it. Stopping kills every actor, removes the placement group and disconnects from Ray.

Connecting follows `ray.init()` (as vLLM): $RAY_ADDRESS, else a cluster already running on this machine (`ray start`),
else a new local one. Ray is an optional extra (`pip install tokenmill[ray]`): only this module imports it.
"""

from __future__ import annotations

import logging
import os
import socket

from tokenmill.config import EngineConfig, ParallelConfig, replace
from tokenmill.socket_security import new_worker_socket_keys

log = logging.getLogger("tokenmill.ray")

PLACEMENT_TIMEOUT_S = 300.0

# This process's link to Ray, shared by every engine in it (data-parallel replicas): whether tokenmill called
# ray.init (then the last engine to stop calls ray.shutdown) and how many engines use it now.
_connection = {"started": False, "users": 0}


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'tokenmill[ray]'") from exc
    return ray


def free_port(host: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WorkerActor:
    """What runs inside one Ray actor (made remote in `RayWorkers`): where it is, then the worker loop."""

    def node(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port()

    def run(self, config_bytes: bytes, rank: int) -> None:
        from tokenmill.processes import setup_logging
        from tokenmill.workers.process import serve_worker

        serve_worker(EngineConfig.from_bytes(config_bytes), rank, setup_logging(f"worker{rank}"))


class RayWorkers:
    """The worker actors of one engine: placed at construction, run by `start`, watched by `dead`, ended by `stop`."""

    def __init__(self, config: EngineConfig) -> None:
        ray = self.ray = _import_ray()
        if not ray.is_initialized():
            ray.init()
            _connection["started"] = True
        _connection["users"] += 1
        self.connected = True
        self.placement_group = None
        self.actors: list = []
        self.runs: list = []
        try:
            self._place(config)
        except BaseException:
            self.stop()
            raise

    def _place(self, config: EngineConfig) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        parallel = config.parallel
        world = parallel.world_size
        on_gpu = parallel.device == "cuda" or (parallel.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        bundle = {"GPU": 1} if on_gpu else {"CPU": 1}
        strategy = os.environ.get("TOKENMILL_RAY_PLACEMENT_STRATEGY", "PACK")
        self.placement_group = placement_group([dict(bundle) for _ in range(world)], strategy=strategy)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {world} workers ({bundle} each, {strategy}) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s: the cluster has {ray.available_resources()} free"
            )
        remote = ray.remote(WorkerActor)
        actors = [
            remote.options(
                num_cpus=0 if on_gpu else 1,
                num_gpus=1 if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=index
                ),
            ).remote()
            for index in range(world)
        ]
        self.actors = actors  # stop() kills them even if the rest of the placement fails
        here = ray.util.get_node_ip_address()
        here_node = ray.get_runtime_context().get_node_id()
        nodes = ray.get([actor.node.remote() for actor in actors])  # (node id, IP) per bundle
        # this node first, then by IP; on one IP (test clusters) by node, so a node's ranks stay contiguous
        order = sorted(
            range(world),
            key=lambda index: (
                nodes[index][1] != here,
                nodes[index][1],
                nodes[index][0] != here_node,
                nodes[index][0],
                index,
            ),
        )
        self.actors = [actors[index] for index in order]
        self.node_ids = [nodes[index][0] for index in order]  # per rank
        self.node_ips = [nodes[index][1] for index in order]
        dist_port = ray.get(self.actors[0].free_port.remote())
        self.parallel: ParallelConfig = replace(
            parallel,
            dist_host=self.node_ips[0],
            dist_port=dist_port,
            worker_addresses={name: f"tcp://{here}:{free_port(here)}" for name in ("plans", "results")},
            worker_socket_keys=new_worker_socket_keys(),
        )  # CURVE on both sockets (tokenmill/socket_security.py)
        log.info(
            "Ray placed %d workers on %d node(s): %s",
            world,
            len(set(self.node_ids)),
            ", ".join(f"rank {rank} on {ip}" for rank, ip in enumerate(self.node_ips)),
        )

    def start(self, config: EngineConfig) -> None:
        """Start every actor's worker loop with the instance's config (whose parallel section is `self.parallel`), less
        what workers must not hold: the API key and the scheduler's CURVE secret key."""
        config_bytes = config.for_workers().to_bytes()
        self.runs = [actor.run.remote(config_bytes, rank) for rank, actor in enumerate(self.actors)]

    def dead(self) -> list[str]:
        """A phrase per worker actor whose loop has ended (an exit, an error, a lost node), without waiting."""
        if not self.runs:
            return []
        done, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        reasons = []
        for ref in done:
            rank = self.runs.index(ref)
            try:
                self.ray.get(ref, timeout=0)
                why = "its worker loop returned"
            except Exception as exc:  # RayActorError and the like: the actor's process or node is gone
                why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            reasons.append(f"tokenmill-worker{rank} (Ray actor on {self.node_ips[rank]}) ended: {why}")
        return reasons

    def stop(self) -> None:
        """Kill every actor, remove the placement group, and disconnect (the last engine shuts down a Ray that
        tokenmill started). Idempotent."""
        if not self.connected:
            return
        self.connected = False
        ray = self.ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("killing a worker actor: %s", exc)
        self.actors, self.runs = [], []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception as exc:
                log.debug("removing the placement group: %s", exc)
            self.placement_group = None
        _connection["users"] -= 1
        if _connection["users"] == 0 and _connection["started"]:
            _connection["started"] = False
            ray.shutdown()
