"""The worker process: load the model, allocate the KV cache, then run every StepPlan the scheduler publishes.

Rank 0 answers each plan with a StepResult; other tensor-parallel ranks compute their shard and stay silent.
Any exception is reported to the scheduler as a WorkerError before the process exits non-zero, so the instance goes
down cleanly instead of hanging.
"""

from __future__ import annotations

import traceback

import zmq

from tokenmill.config import EngineConfig
from tokenmill.messages import Shutdown, StepPlan, WorkerCommand, WorkerError, WorkerReady, decoder, encode
from tokenmill.processes import become_child_process, make_socket


def run_worker_process(config_bytes: bytes, rank: int) -> None:
    """Entry point of worker `rank` (started by the launcher)."""
    log = become_child_process(f"worker{rank}")
    config = EngineConfig.from_bytes(config_bytes)
    ctx = zmq.Context()
    plans = make_socket(ctx, zmq.SUB, config.ipc_address("plans"), bind=False)
    results = make_socket(ctx, zmq.PUSH, config.ipc_address("results"), bind=False)
    try:
        if config.model.task == "embed":
            from tokenmill.workers.embedding_runner import EmbeddingRunner as Runner
        else:
            from tokenmill.workers.model_runner import ModelRunner as Runner

        runner = Runner(config, rank=rank)
        runner.load_model()
        num_blocks = runner.num_kv_blocks_for_budget()
        runner.allocate_kv_cache(num_blocks)
        runner.capture_cuda_graphs()
        results.send(encode(WorkerReady(
            rank=rank, num_kv_blocks=num_blocks, weight_bytes=runner.weight_bytes, device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."), architecture=runner.architecture,
            eos_token_ids=list(runner.eos_token_ids), vocab_size=runner.vocab_size,
            sliding_window=getattr(runner.model, "kv_sliding_window", None))))
        commands = decoder(WorkerCommand)
        while True:
            command = commands.decode(plans.recv())
            if isinstance(command, Shutdown):
                break
            assert isinstance(command, StepPlan)
            result = runner.execute(command)
            if rank == 0:
                results.send(encode(result))
    except Exception as exc:
        log.error("worker %d failed:\n%s", rank, traceback.format_exc())
        results.send(encode(WorkerError(rank, f"{type(exc).__name__}: {exc}")))
        raise SystemExit(1)
    finally:
        ctx.destroy(linger=200)
