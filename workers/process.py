"""The worker process: load the model, allocate the KV cache, then run every StepPlan the scheduler publishes.

The last pipeline stage's tensor-parallel rank 0 (rank 0 without pipeline stages) answers each plan with a
StepResult; the other ranks compute their share and stay silent. A Ray actor (tokenmill/ray_executor.py) runs
`serve_worker` as a subprocess's `run_worker_process` does, with TCP sockets instead of ipc:// ones.
Any exception is reported to the scheduler as a WorkerError before the process exits non-zero, so the instance goes
down cleanly instead of hanging.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import TYPE_CHECKING

import zmq

from tokenmill.config import EngineConfig
from tokenmill.gc_heap import freeze_startup_heap
from tokenmill.messages import Shutdown, StepPlan, WorkerCommand, WorkerError, WorkerReady, decoder, encode
from tokenmill.processes import become_child_process, decode_or_drop, worker_socket

if TYPE_CHECKING:  # imported where a worker starts: the launcher imports this module and must not load torch
    from tokenmill.workers.worker import Worker


def run_worker_process(config_bytes: bytes, rank: int) -> None:
    """Entry point of worker `rank` (started by the launcher)."""
    log = become_child_process(f"worker{rank}")
    serve_worker(EngineConfig.from_bytes(config_bytes), rank, log)


def serve_worker(config: EngineConfig, rank: int, log: logging.Logger) -> None:
    """Load, report ready, then run plans until Shutdown; raises SystemExit(1) after reporting a failure."""
    replying_rank = (config.parallel.pipeline_parallel_size - 1) * config.parallel.tensor_parallel_size
    ctx = zmq.Context()
    plans = worker_socket(ctx, config, "plans", zmq.SUB, bind=False)
    results = worker_socket(ctx, config, "results", zmq.PUSH, bind=False)
    try:
        runner = make_worker(config, rank)
        runner.load_model()
        num_blocks = runner.num_kv_blocks_for_budget()
        runner.allocate_kv_cache(num_blocks)
        runner.warm_up_kernels()  # before WorkerReady: /health answers 200 only once the kernels are compiled
        runner.capture_cuda_graphs()
        freeze_startup_heap()
        results.send(
            encode(
                WorkerReady(
                    rank=rank,
                    num_kv_blocks=num_blocks,
                    weight_bytes=runner.weight_bytes,
                    device=str(runner.device),
                    dtype=str(runner.dtype).removeprefix("torch."),
                    architecture=runner.architecture,
                    eos_token_ids=list(runner.eos_token_ids),
                    vocab_size=runner.vocab_size,
                    sliding_window=runner.kv_sliding_window,
                    prompt_logprobs_row_cost=runner.prompt_logprobs_row_cost,
                    pid=os.getpid(),
                    replayed_step_seqs=runner.replayed_step[0],
                    replayed_step_tokens=runner.replayed_step[1],
                )
            )
        )
        commands = decoder(WorkerCommand)
        while True:
            command = decode_or_drop(commands, plans.recv(), log, "the scheduler")
            if command is None:
                continue
            if isinstance(command, Shutdown):
                break
            assert isinstance(command, StepPlan)
            result = runner.execute(command)
            if rank == replying_rank:
                results.send(encode(result))
    except Exception as exc:
        log.error("worker %d failed:\n%s", rank, traceback.format_exc())
        results.send(encode(WorkerError(rank, f"{type(exc).__name__}: {exc}")))
        raise SystemExit(1) from exc
    finally:
        ctx.destroy(linger=200)


def make_worker(config: EngineConfig, rank: int) -> Worker:
    """The worker of a generation instance, the embedding runner of an embedding one, the scoring runner of a
    sequence classifier (--task classify / score)."""
    if config.model.task in ("classify", "score"):
        from tokenmill.workers.scoring_runner import ScoringRunner

        return ScoringRunner(config, rank=rank)
    if config.model.task == "embed":
        from tokenmill.workers.embedding_runner import EmbeddingRunner

        return EmbeddingRunner(config, rank=rank)
    from tokenmill.workers.worker import Worker

    return Worker(config, rank=rank)
