"""One step through pipeline stages: the step's requests split into micro-batches that flow through the stages
GPipe-style, so while stage s runs micro-batch m, stage s - 1 already runs micro-batch m + 1.

Every rank gets the same StepPlan, so every rank cuts the same micro-batches and knows the shape of what it will
receive: no sizes travel, only the hidden states and the residual (stacked into one `[2, T, H]` tensor) from each
rank to the rank of the same tensor-parallel index in the next stage, by torch.distributed point-to-point (gloo on
CPU, NCCL on GPU). Sends are asynchronous, so a stage goes on to its next micro-batch at once; receives block.
Only the last stage has the final hidden states; its tensor-parallel rank 0 samples and answers the scheduler, and
the sampled tokens reach every stage with the next plan, as they reach every tensor-parallel rank.

Ranks are ordered as vLLM's: global rank = stage * tensor_parallel_size + tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tokenmill.workers.attention import AttentionMetadata
from tokenmill.workers.kv_cache import KVCache
from tokenmill.workers.models.layers import TensorParallel
from tokenmill.workers.models.pipeline import PipelineStage
from tokenmill.workers.request_state import ScheduledRequest
from tokenmill.workers.step_inputs import StepBatch, join_step_batches


def micro_batches(scheduled: Sequence[ScheduledRequest], num_stages: int) -> list[list[ScheduledRequest]]:
    """Up to `num_stages` contiguous groups of whole requests with about equal token counts; fewer when the step
    has fewer requests. Contiguous, so the groups' rows concatenate into the step's."""
    count = min(num_stages, len(scheduled))
    total = sum(entry.num_scheduled_tokens for entry in scheduled)
    groups: list[list[ScheduledRequest]] = [[] for _ in range(count)]
    done = 0
    for index, entry in enumerate(scheduled):
        left = len(scheduled) - index
        group = min(count - 1, done * count // max(1, total))
        group = max(group, count - left)  # leave at least one request for each group still empty
        while group > 0 and not groups[group - 1]:
            group -= 1  # never skip a group
        groups[group].append(entry)
        done += entry.num_scheduled_tokens
    return groups


def stage_forward(
    model: torch.nn.Module,
    pp: PipelineStage,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionMetadata,
    kv_caches: Sequence[KVCache],
    intermediate: torch.Tensor | None = None,
) -> torch.Tensor:
    """This stage's layers over one (micro-)batch: final hidden states on the last stage, else `[2, T, H]`
    (hidden, residual) for the next. A first stage embeds `input_ids`; a later one starts from `intermediate`."""
    if pp.size == 1:
        hidden: torch.Tensor = model(input_ids, positions, attn, kv_caches)
        return hidden
    if not pp.is_first and intermediate is None:
        raise ValueError(f"pipeline stage {pp.rank} needs the previous stage's hidden states")
    out = model(
        input_ids, positions, attn, kv_caches, None if intermediate is None else (intermediate[0], intermediate[1])
    )
    return out if pp.is_last else torch.stack(out)


def pipelined_forward(
    model: torch.nn.Module,
    pp: PipelineStage,
    tp: TensorParallel,
    kv_caches: Sequence[KVCache],
    scheduled: Sequence[ScheduledRequest],
    prepare: Callable[[Sequence[ScheduledRequest]], StepBatch],
    dtype: torch.dtype,
    hidden_size: int,
) -> tuple[StepBatch, torch.Tensor | None]:
    """(the step's batch, final hidden states) on the last stage; (the batch, None) on the others.

    `prepare` builds one micro-batch; the returned batch joins them (`join_step_batches`). `dtype` and
    `hidden_size`: the activations' that pass between stages."""
    batches = [prepare(group) for group in micro_batches(scheduled, pp.size)]
    previous_rank = (pp.rank - 1) * tp.size + tp.rank
    next_rank = (pp.rank + 1) * tp.size + tp.rank
    outputs: list[torch.Tensor] = []
    sends: list[tuple[dist.Work | None, torch.Tensor]] = []
    for index, batch in enumerate(batches):
        intermediate = None
        if not pp.is_first:
            intermediate = torch.empty(
                2, batch.input_ids.shape[0], hidden_size, dtype=dtype, device=batch.input_ids.device
            )
            dist.recv(intermediate, src=previous_rank, tag=index)
        out = stage_forward(model, pp, batch.input_ids, batch.positions, batch.attn, kv_caches, intermediate)
        if pp.is_last:
            outputs.append(out)
        else:
            out = out.contiguous()
            sends.append((dist.isend(out, dst=next_rank, tag=index), out))  # keep the tensor until it is sent
    for work, _ in sends:
        if work is not None:  # None: this rank is not in the group (never, with the default group)
            work.wait()
    return join_step_batches(batches), (torch.cat(outputs) if pp.is_last else None)
