"""A step's inputs: the flat batch of token ids and positions, its attention metadata and the rows to sample.

Prompts, prompt chunks and decode tokens all run in one flat batch and one forward. Only requests whose scheduled
tokens reach the end of their known tokens are sampled, at their last row; with speculative decoding also at every
draft row after it. This module is the one place a step's inputs are built (host arrays first, one copy to the
device per tensor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.workers.attention import AttentionBackend, AttentionMetadata, build_attention_metadata, token_positions
from tokenmill.workers.lora.manager import LoRAManager
from tokenmill.workers.request_state import CachedRequest, ScheduledRequest


@dataclass
class StepBatch:
    """Everything the forward and the sample stage read about one step (or one pipeline micro-batch)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [N] rows of the flat batch whose hidden state is sampled
    sampled_requests: list[CachedRequest]
    # speculative decoding: per sampled request its draft tokens (1 + len rows each in sample_rows); None: no drafts
    drafts: list[list[int]] | None = None
    # multi-LoRA: each row's adapter slot (-1: the base model); None when no request of the step has an adapter
    lora_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class InputPreparer:
    """Builds `StepBatch`es for one worker's device and attention backend."""

    block_size: int
    device: torch.device
    backend: AttentionBackend
    decode_chunk_tokens: int | None  # keys per decode-attention chunk on the torch path (attention.py)
    sliding_windows: tuple[int, ...] = ()  # the models' distinct windows, whose attention reads prepare precomputes
    lora: LoRAManager | None = None  # with --enable-lora: the adapters' slots, assigned here once per step

    def prepare(self, scheduled: Sequence[ScheduledRequest], drafts: dict[str, list[int]]) -> StepBatch:
        """The flat batch of `scheduled`; `drafts` (request id -> draft tokens scheduled after its known tokens, this
        step only): such a request is sampled at its last known token and at every draft."""
        num_seqs = len(scheduled)
        query_lens = np.fromiter((entry.num_scheduled_tokens for entry in scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((entry.num_computed_tokens for entry in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = starts + query_lens
        blocks_needed = -(-seq_lens // self.block_size)
        block_tables = np.zeros((num_seqs, int(blocks_needed.max())), dtype=np.int64)
        input_ids: list[int] = []
        sample_rows: list[int] = []
        sampled_requests: list[CachedRequest] = []
        sampled_drafts: list[list[int]] = []
        end_row = 0
        for seq, (request, start, num_tokens) in enumerate(scheduled):
            request_drafts = drafts.get(request.request_id, [])
            known = _check_schedulable(request, start, num_tokens, request_drafts, int(blocks_needed[seq]))
            input_ids.extend(request.token_ids[start : start + num_tokens])
            input_ids.extend(request_drafts)
            block_tables[seq, : blocks_needed[seq]] = request.block_ids[: blocks_needed[seq]]
            end_row += num_tokens
            if start + num_tokens == known and request.sampling is not None:
                sample_rows.extend(range(end_row - 1 - len(request_drafts), end_row))
                sampled_requests.append(request)
                sampled_drafts.append(list(request_drafts))
        device = self.device
        return StepBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long).to(device),
            positions=torch.from_numpy(token_positions(query_lens, seq_lens)).to(device),
            attn=build_attention_metadata(
                query_lens,
                seq_lens,
                block_tables,
                self.block_size,
                device,
                self.backend,
                self.decode_chunk_tokens,
                self.sliding_windows,
            ),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long).to(device),
            sampled_requests=sampled_requests,
            drafts=sampled_drafts if drafts else None,
            lora_slots=self._lora_slots(scheduled, query_lens),
        )

    def _lora_slots(self, scheduled: Sequence[ScheduledRequest], query_lens: np.ndarray) -> torch.Tensor | None:
        """Every row's adapter slot (the adapters not in a slot are loaded now); None when no request has one."""
        requests = [entry.request.lora_request for entry in scheduled]
        if self.lora is None or all(request is None for request in requests):
            return None
        slots = np.asarray(self.lora.assign_slots(requests), dtype=np.int64)
        return torch.from_numpy(np.repeat(slots, query_lens)).to(self.device)


def _check_schedulable(
    request: CachedRequest, start: int, num_tokens: int, drafts: list[int], blocks_needed: int
) -> int:
    """The tokens `request` knows this step (its own and its drafts); raises when the plan asks for more than that,
    for drafts not at its end, or for more blocks than it holds."""
    end = start + num_tokens
    known = len(request.token_ids) + len(drafts)
    if end > known or (drafts and end != known) or blocks_needed > len(request.block_ids):
        raise ValueError(
            f"request {request.request_id}: {num_tokens} tokens scheduled from {start} but it knows "
            f"{known} tokens and {len(request.block_ids)} blocks"
        )
    return known


def join_step_batches(batches: list[StepBatch]) -> StepBatch:
    """One batch from contiguous micro-batches (pipeline parallelism): rows, sampled requests and drafts in step
    order, sample rows shifted by the rows before them. Its `attn` is the first micro-batch's, read by nothing."""
    if len(batches) == 1:
        return batches[0]
    rows, offset = [], 0
    for batch in batches:
        rows.append(batch.sample_rows + offset)
        offset += batch.input_ids.shape[0]
    drafts = None
    if batches[0].drafts is not None:
        drafts = [draft for batch in batches for draft in batch.drafts or []]
    return dataclasses.replace(
        batches[0],
        input_ids=torch.cat([batch.input_ids for batch in batches]),
        positions=torch.cat([batch.positions for batch in batches]),
        sample_rows=torch.cat(rows),
        sampled_requests=[request for batch in batches for request in batch.sampled_requests],
        drafts=drafts,
    )
