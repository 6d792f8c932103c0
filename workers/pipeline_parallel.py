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

import dataclasses
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from tokenmill.workers.models.layers import TensorParallel
from tokenmill.workers.models.pipeline import PipelineStage

Entry = TypeVar("Entry")


def micro_batches(scheduled: Sequence[Entry], num_stages: int) -> list[list[Entry]]:
    """Up to `num_stages` contiguous groups of whole requests with about equal token counts (the entries' third
    field); fewer when the step has fewer requests. Contiguous, so the groups' rows concatenate into the step's."""
    count = min(num_stages, len(scheduled))
    total = sum(entry[2] for entry in scheduled)
    groups: list[list[Entry]] = [[] for _ in range(count)]
    done = 0
    for index, entry in enumerate(scheduled):
        left = len(scheduled) - index
        group = min(count - 1, done * count // max(1, total))
        group = max(group, count - left)  # leave at least one request for each group still empty
        while group > 0 and not groups[group - 1]:
            group -= 1  # never skip a group
        groups[group].append(entry)
        done += entry[2]
    return groups


def stage_forward(model, pp: PipelineStage, input_ids: torch.Tensor, positions: torch.Tensor, attn, kv_caches,
                  intermediate: torch.Tensor | None = None):
    """This stage's layers over one (micro-)batch: final hidden states on the last stage, else `[2, T, H]`
    (hidden, residual) for the next. A first stage embeds `input_ids`; a later one starts from `intermediate`
    (zeros when None: start-up profiling)."""
    if pp.size == 1:
        return model(input_ids, positions, attn, kv_caches)
    if not pp.is_first and intermediate is None:
        norm = model.model.layers[model.model.start_layer].input_layernorm.weight  # in the activations' dtype
        intermediate = torch.zeros(2, input_ids.shape[0], norm.shape[0], dtype=norm.dtype, device=input_ids.device)
    out = model(input_ids, positions, attn, kv_caches, None if pp.is_first else (intermediate[0], intermediate[1]))
    return out if pp.is_last else torch.stack(out)


def pipelined_forward(model, pp: PipelineStage, tp: TensorParallel, kv_caches, scheduled: Sequence,
                      prepare: Callable[[Sequence], object], dtype: torch.dtype):
    """(the step's batch, final hidden states) on the last stage; (the batch, None) on the others.

    `prepare` builds one micro-batch (the model runner's `_prepare_batch`); the returned batch joins them: rows,
    sampled requests and drafts in step order (its `attn` is the first micro-batch's, used by none)."""
    batches = [prepare(group) for group in micro_batches(scheduled, pp.size)]
    previous_rank = (pp.rank - 1) * tp.size + tp.rank
    next_rank = (pp.rank + 1) * tp.size + tp.rank
    outputs: list[torch.Tensor] = []
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    for index, batch in enumerate(batches):
        intermediate = None
        if not pp.is_first:
            num_tokens = batch.input_ids.shape[0]
            intermediate = torch.empty(2, num_tokens, model.config.hidden_size, dtype=dtype,
                                       device=batch.input_ids.device)
            dist.recv(intermediate, src=previous_rank, tag=index)
        out = stage_forward(model, pp, batch.input_ids, batch.positions, batch.attn, kv_caches, intermediate)
        if pp.is_last:
            outputs.append(out)
        else:
            out = out.contiguous()
            sends.append((dist.isend(out, dst=next_rank, tag=index), out))  # keep the tensor until it is sent
    for work, _ in sends:
        work.wait()
    joined = _join(batches)
    return joined, (torch.cat(outputs) if pp.is_last else None)


def _join(batches: list):
    """One batch from contiguous micro-batches: sample rows shifted by the rows before them."""
    if len(batches) == 1:
        return batches[0]
    rows, offset = [], 0
    for batch in batches:
        rows.append(batch.sample_rows + offset)
        offset += batch.input_ids.shape[0]
    drafts = getattr(batches[0], "drafts", None)
    changes = dict(
        input_ids=torch.cat([batch.input_ids for batch in batches]),
        positions=torch.cat([batch.positions for batch in batches]),
        sample_rows=torch.cat(rows),
        sampled_requests=[request for batch in batches for request in batch.sampled_requests],
    )
    if drafts is not None:
        changes["drafts"] = [draft for batch in batches for draft in batch.drafts]
    return dataclasses.replace(batches[0], **changes)
