"""A worker's device and its torch.distributed groups (tensor and pipeline parallelism).

Ranks are ordered as vLLM's: stage-major, the tensor-parallel ranks of one stage contiguous
(global rank = stage * tensor_parallel_size + tensor-parallel rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.workers.models.layers import TensorParallel
from tokenmill.workers.models.pipeline import PipelineStage
from tokenmill.workers.rendezvous import rendezvous_store


def resolve_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:<rank> when CUDA is asked for (or available under "auto"), else cpu.

    The index wraps at the visible device count: a Ray actor sees only its own GPU (CUDA_VISIBLE_DEVICES)."""
    wanted = config.parallel.device
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def parallel_position(config: EngineConfig, rank: int) -> tuple[PipelineStage, TensorParallel]:
    """This rank's pipeline stage and tensor-parallel rank (its group is set by `init_distributed`)."""
    parallel = config.parallel
    pp = PipelineStage(rank // parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    tp = TensorParallel(rank % parallel.tensor_parallel_size, parallel.tensor_parallel_size)
    return pp, tp


def init_distributed(
    config: EngineConfig, rank: int, device: torch.device, pp: PipelineStage, tp: TensorParallel
) -> TensorParallel:
    """Join the world (every stage's every rank); with pipeline stages, each stage's tensor-parallel group.

    Returns `tp` with its group set (the default group without pipeline stages)."""
    if dist.is_initialized():
        return tp
    join_process_group(config, rank, "nccl" if device.type == "cuda" else "gloo")
    if pp.size > 1 and tp.size > 1:
        size = tp.size
        groups = [dist.new_group(list(range(stage * size, (stage + 1) * size))) for stage in range(pp.size)]
        return tp._replace(group=groups[pp.rank])  # every rank makes every group, in one order
    return tp


def join_process_group(config: EngineConfig, rank: int, backend: str) -> None:
    """The rendezvous: every rank meets at the TCP store of parallel.dist_host:dist_port (rank 0 hosts it)."""
    parallel = config.parallel
    if not parallel.dist_port:
        raise ValueError("tensor or pipeline parallelism needs parallel.dist_port")
    dist.init_process_group(
        backend=backend,
        store=rendezvous_store(parallel.dist_host, parallel.dist_port, rank, parallel.world_size),
        rank=rank,
        world_size=parallel.world_size,
    )


def broadcast_from_group_leader(values: torch.Tensor, rank: int, tp: TensorParallel) -> torch.Tensor:
    """`values` as tensor-parallel rank 0 of this rank's group holds them, on every rank of the group (in place)."""
    dist.broadcast(values, src=rank - tp.rank, group=tp.group)  # src: the group's rank 0, as a global rank
    return values
