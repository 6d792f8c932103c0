"""The KV budget on CUDA (`--gpu-memory-utilization`): the arithmetic of `Worker._num_kv_blocks_on_gpu`, with
the CUDA memory queries and the profiling step replaced by fixed numbers (no GPU here)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenmill.workers.worker import Worker

GIB = 1 << 30


@pytest.fixture
def gpu_runner(tiny_checkpoint, monkeypatch):
    """`make(...)`: a runner whose CUDA memory readings are the given GiB figures; returns (runner, KV GiB granted)."""
    path, _ = tiny_checkpoint("llama")

    def make(*, total, free_at_start, free_now, reserved, peak, utilization=0.9, enforce_eager=True, max_num_seqs=256):
        config = EngineConfig(
            model=ModelConfig(path=str(path), enforce_eager=enforce_eager),
            cache=CacheConfig(gpu_memory_utilization=utilization),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
            parallel=ParallelConfig(device="cpu"),
        )
        runner = Worker(config)
        runner.load_model()
        runner.device = torch.device("cuda", 0)  # only the arithmetic runs: every CUDA query below is replaced
        runner._cuda_memory_at_start = (int(free_at_start * GIB), int(total * GIB))
        monkeypatch.setattr(runner, "_profile_peak_memory", lambda: int(peak * GIB))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_now * GIB), int(total * GIB)))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved * GIB))
        return runner, runner._num_kv_blocks_on_gpu() * runner.kv_block_bytes() / GIB

    return make


def test_alone_on_the_gpu_the_share_bounds_the_cache(gpu_runner):
    # 80 GiB GPU; weights 2 GiB, activations 1 GiB, 0.25 GiB taken outside torch (NCCL, cuBLAS) since start-up
    _, kv_gib = gpu_runner(total=80, free_at_start=79.5, free_now=77.25, reserved=2, peak=3)
    assert kv_gib == pytest.approx(0.9 * 80 - 3 - 0.25, abs=0.01)


def test_a_second_process_on_the_gpu_caps_it_at_what_is_free(gpu_runner):
    # another instance already holds 40 GiB: 0.9 of the GPU is no longer there to take; activations still need room
    _, kv_gib = gpu_runner(total=80, free_at_start=39.5, free_now=37.25, reserved=2, peak=3)
    assert kv_gib == pytest.approx(37.25 - 1, abs=0.01)


def test_decode_graphs_are_set_aside(gpu_runner):
    # graphs up to 256 sequences: the profiled 2048-token step's activations scaled by 256 / 2048
    _, kv_gib = gpu_runner(total=80, free_at_start=79.5, free_now=77.25, reserved=2, peak=3, enforce_eager=False)
    assert kv_gib == pytest.approx(0.9 * 80 - 3 - 0.25 - 1 * 256 / 2048, abs=0.01)


def test_no_room_left_is_a_clear_error(gpu_runner):
    with pytest.raises(RuntimeError, match="no GPU memory left for the KV cache.*--gpu-memory-utilization"):
        gpu_runner(total=16, free_at_start=15.5, free_now=10, reserved=5, peak=8, utilization=0.5)
