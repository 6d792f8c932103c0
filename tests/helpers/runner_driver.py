"""Drivers for worker tests: a toy scheduler feeding `Worker.execute` hand-built StepPlans, and a helper
that runs a bare model over one sequence in chunks through a paged cache.

The toy scheduler schedules every request every step once it has arrived: its prompt in chunks of at most
`chunk_size` tokens, then one token per step. Blocks come from a shuffled pool and return to it when a request
finishes, so block ids are non-contiguous and reused (with stale contents). Plans go through the msgpack codec, as on
the wire. The driver also checks the runner's promise that exactly the requests whose scheduled tokens reach the end
of their known tokens get a sampled token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.messages import (
    LoRARequest,
    NewRequestData,
    RunningRequestData,
    SamplingParams,
    StepPlan,
    WorkerCommand,
    decoder,
    encode,
)
from tokenmill.workers.attention import build_attention_metadata
from tokenmill.workers.backends import attention_backend
from tokenmill.workers.worker import Worker

BLOCK_SIZE = 4
NUM_BLOCKS = 96

_plan_decoder = decoder(WorkerCommand)


def logits_in_chunks(
    model,
    input_ids: torch.Tensor,
    chunk_bounds: list[int],
    block_size: int = 4,
    kv_cache_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Run one sequence through a fresh paged cache (shuffled blocks; the default dtype unless `kv_cache_dtype`) in
    chunks; float32 logits of every position."""
    num_blocks = -(-len(input_ids) // block_size) + 8
    shape = model.kv_cache_shape(num_blocks, block_size)
    kv_caches = [
        (torch.zeros(shape, dtype=kv_cache_dtype), torch.zeros(shape, dtype=kv_cache_dtype))
        for _ in range(model.num_layers)
    ]
    blocks = np.random.default_rng(0).permutation(num_blocks)
    logits = []
    for start, end in zip(chunk_bounds, chunk_bounds[1:]):
        needed = -(-end // block_size)
        meta = build_attention_metadata(
            np.array([end - start]),
            np.array([end]),
            blocks[None, :needed],
            block_size,
            torch.device("cpu"),
            attention_backend("cpu"),
        )
        with torch.inference_mode():
            hidden = model(input_ids[start:end], torch.arange(start, end), meta, kv_caches)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


@dataclass
class _Sequence:
    request_id: str
    prompt: list[int]
    arrival_step: int
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    known_by_worker: bool = False
    unsent_token_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.outputs


def run_greedy(
    runner,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    num_blocks: int,
    chunk_size: int | None = None,
    arrival_steps: list[int] | None = None,
    preempt: tuple[int, int] | None = None,
    seed: int = 0,
    lora_requests: list[LoRARequest | None] | None = None,
) -> list[list[int]]:
    """Greedy-generate `max_new_tokens` for every prompt; returns the outputs in prompt order.

    `preempt=(index, step)` drops request `index` at that step (blocks freed, worker told to forget it) and
    resends it in full, prompt plus outputs so far, the next step: recompute-style preemption.
    `lora_requests`: each prompt's LoRA adapter (None: the base model).
    """
    rng = random.Random(seed)
    block_size = runner.block_size
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    arrival_steps = arrival_steps or [0] * len(prompts)
    sequences = [_Sequence(f"req-{i}", list(p), arrival_steps[i]) for i, p in enumerate(prompts)]
    loras = dict(zip([seq.request_id for seq in sequences], lora_requests or [None] * len(prompts), strict=True))
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    finished_ids: list[str] = []
    step = 0
    while any(len(seq.outputs) < max_new_tokens for seq in sequences):
        if preempt is not None and step == preempt[1]:
            victim = sequences[preempt[0]]
            finished_ids.append(victim.request_id)
            free_blocks.extend(victim.block_ids)
            rng.shuffle(free_blocks)
            victim.block_ids, victim.num_computed, victim.known_by_worker = [], 0, False
            victim.unsent_token_ids = []
            step += 1
            continue

        new_requests, running, scheduled = [], [], []
        for seq in sequences:
            if seq.arrival_step > step or len(seq.outputs) >= max_new_tokens:
                continue
            remaining = len(seq.token_ids) - seq.num_computed
            num_tokens = min(remaining, chunk_size or remaining)
            blocks_needed = -(-(seq.num_computed + num_tokens) // block_size)
            new_blocks = [free_blocks.pop() for _ in range(blocks_needed - len(seq.block_ids))]
            seq.block_ids += new_blocks
            if not seq.known_by_worker:
                new_requests.append(
                    NewRequestData(
                        seq.request_id,
                        seq.token_ids,
                        len(seq.prompt),
                        params,
                        list(seq.block_ids),
                        seq.num_computed,
                        num_tokens,
                        lora_request=loras[seq.request_id],
                    )
                )
                seq.known_by_worker = True
            else:
                running.append(
                    RunningRequestData(seq.request_id, seq.unsent_token_ids, new_blocks, seq.num_computed, num_tokens)
                )
            seq.unsent_token_ids = []
            scheduled.append((seq, num_tokens))

        plan = _plan_decoder.decode(encode(StepPlan(step, new_requests, running, finished_ids)))
        finished_ids = []
        result = runner.execute(plan)

        expected = {seq.request_id for seq, n in scheduled if seq.num_computed + n == len(seq.token_ids)}
        assert set(result.request_ids) == expected, f"step {step}: sampled {result.request_ids}, expected {expected}"
        assert result.step_id == step
        by_id = {seq.request_id: seq for seq in sequences}
        for seq, num_tokens in scheduled:
            seq.num_computed += num_tokens
        for request_id, token_id in zip(result.request_ids, result.sampled_token_ids, strict=True):
            seq = by_id[request_id]
            seq.outputs.append(token_id)
            seq.unsent_token_ids = [token_id]
            if len(seq.outputs) == max_new_tokens:
                finished_ids.append(request_id)
                free_blocks.extend(seq.block_ids)
                rng.shuffle(free_blocks)
                seq.block_ids = []
        step += 1
    if finished_ids:  # a last, empty plan so the runner forgets the requests that finished in the final step
        assert runner.execute(StepPlan(step, [], [], finished_ids)).request_ids == []
    return [seq.outputs for seq in sequences]


def make_runner(path, block_size: int = BLOCK_SIZE, num_blocks: int = NUM_BLOCKS, **cache) -> Worker:
    config = EngineConfig(
        model=ModelConfig(path=str(path)),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, **cache),
        parallel=ParallelConfig(device="cpu"),
    )
    runner = Worker(config)
    runner.load_model()
    runner.allocate_kv_cache(runner.num_kv_blocks_for_budget())
    return runner
