"""A model runner on the Triton attention backend (run on CPU under TRITON_INTERPRET) and its test schedule."""

from __future__ import annotations

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenmill.workers.worker import Worker

CHUNKS = [0, 9, 21, 22, 23]  # two prefill chunks, then two single-token (decode-only) steps
BLOCK_SIZE = 4
NUM_BLOCKS = 64


def make_runner(path, max_num_seqs: int = 256) -> Worker:
    config = EngineConfig(
        model=ModelConfig(path=str(path), max_model_len=128),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        parallel=ParallelConfig(device="cpu"),
    )
    runner = Worker(config)
    runner.load_model()
    runner.allocate_kv_cache(runner.num_kv_blocks_for_budget())
    return runner


def force_triton_on_cpu(monkeypatch) -> None:
    """Make `attention_backend("cpu")` the Triton backend (interpreted on CPU) until the monkeypatch is undone; the
    caller clears `backends.device_kernels` again afterwards."""
    from tokenmill.workers import backends

    monkeypatch.setattr(backends, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    backends.device_kernels.cache_clear()
