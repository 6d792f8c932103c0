"""LoRA under tensor parallelism on CPU: two gloo ranks of a model whose heads split unevenly (3 KV heads: 2 + 1) and
an adapter on every projection, A and B sharded as their base layers (column-parallel: B's rows of the rank's heads
or MLP columns; row-parallel: A's columns of its inputs, the delta summed by the all-reduce). Both ranks reproduce
transformers + PEFT's logits."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.lora_adapters import ALL_PROJECTIONS, make_peft_model, save_peft_adapter
from tests.helpers.runner_driver import logits_in_chunks
from tests.helpers.server import free_port
from tokenmill.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig
from tokenmill.messages import LoRARequest
from tokenmill.workers.worker import Worker

NUM_TOKENS = 19


def run_rank(rank: int, path: str, adapter: LoRARequest, port: int, input_ids: torch.Tensor, out_dir: str) -> None:
    torch.set_num_threads(1)
    config = EngineConfig(
        model=ModelConfig(path=path),
        cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 20),
        parallel=ParallelConfig(device="cpu", tensor_parallel_size=2, dist_port=port),
        lora=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8),
    )
    runner = Worker(config, rank=rank)
    try:
        runner.load_model()
        assert runner.lora is not None
        [slot] = runner.lora.assign_slots([adapter])
        runner.lora.begin_step(torch.full((NUM_TOKENS,), slot, dtype=torch.long))  # every token on the adapter
        torch.save(logits_in_chunks(runner.model, input_ids, [0, NUM_TOKENS]), f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # rank 0 hosts the store: neither rank tears down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_two_ranks_reproduce_peft_logits_with_sharded_adapters(tiny_checkpoint, tmp_path):
    path, hf_model = tiny_checkpoint("llama-uneven-tp")
    peft_model = make_peft_model(hf_model, 8, ALL_PROJECTIONS, seed=5)
    adapter = LoRARequest("tp", 1, str(save_peft_adapter(peft_model, tmp_path / "adapter")))
    input_ids = torch.randint(3, hf_model.config.vocab_size, (NUM_TOKENS,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = peft_model(input_ids=input_ids[None]).logits[0]
        base = hf_model(input_ids[None]).logits[0]
    assert not torch.allclose(expected, base, atol=1e-2)  # the adapter matters
    mp.start_processes(run_rank, args=(str(path), adapter, free_port(), input_ids, str(tmp_path)), nprocs=2)
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), expected, atol=1e-4, rtol=1e-4)
