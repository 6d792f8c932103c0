"""Tensor parallelism on CPU: two gloo ranks, each holding its share of the heads, MLP columns and vocabulary, give
the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.runner_driver import logits_in_chunks
from tests.helpers.server import free_port
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.workers.worker import Worker

CHUNKS = [0, 9, 21, 22, 23]
KV_BUDGET_BYTES = 1 << 20


def run_rank(rank: int, path: str, port: int, input_ids: torch.Tensor, out_dir: str) -> None:
    torch.set_num_threads(1)
    config = EngineConfig(
        model=ModelConfig(path=path),
        cache=CacheConfig(block_size=4, kv_cache_memory_bytes=KV_BUDGET_BYTES),
        parallel=ParallelConfig(device="cpu", tensor_parallel_size=2, dist_port=port),
    )
    runner = Worker(config, rank=rank)
    try:
        runner.load_model()
        attention = runner.model.model.layers[0].self_attn
        torch.save(
            {
                "logits": logits_in_chunks(runner.model, input_ids, CHUNKS),
                "heads": (attention.num_heads, attention.num_kv_heads),
                "num_blocks": runner.num_kv_blocks_for_budget(),
            },
            f"{out_dir}/rank{rank}.pt",
        )
        dist.barrier()  # rank 0 hosts the store: neither rank tears down while the other still uses it
    finally:
        dist.destroy_process_group()


# per kind: (query heads, KV heads) on rank 0 and on rank 1
HEADS_PER_RANK = {
    "llama": [(2, 1), (2, 1)],
    "qwen2": [(2, 1), (2, 1)],  # its single KV head is replicated on both ranks
    "llama-uneven-tp": [(4, 2), (2, 1)],  # 3 KV heads (2 query heads each) split 2 + 1; vocabulary 321 split 161 + 160
}


@pytest.mark.parametrize("kind", list(HEADS_PER_RANK))
def test_two_ranks_reproduce_single_rank_logits(tiny_checkpoint, tmp_path, kind):
    path, hf_model = tiny_checkpoint(kind)
    input_ids = torch.randint(3, hf_model.config.vocab_size, (CHUNKS[-1],), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0]
    args = (str(path), free_port(), input_ids, str(tmp_path))
    mp.start_processes(run_rank, args=args, nprocs=2, start_method="spawn")
    most_kv_heads = max(kv for _, kv in HEADS_PER_RANK[kind])
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["heads"] == HEADS_PER_RANK[kind][rank]
        # the ranks agree on the smaller count: K and V, 2 layers, 4-token blocks, kv heads of 16 dims, float32
        assert result["num_blocks"] == KV_BUDGET_BYTES // (2 * 2 * 4 * most_kv_heads * 16 * 4)
        torch.testing.assert_close(result["logits"], expected, atol=1e-4, rtol=1e-4)
