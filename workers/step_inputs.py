"""A step's inputs: the flat batch of token ids and positions, its attention metadata and the rows to sample.

Prompts, prompt chunks and decode tokens all run in one flat batch and one forward. Only requests whose scheduled
tokens reach the end of their known tokens are sampled, at their last row; with speculative decoding also at every
draft row after it. This module is the one place a step's inputs are built: host arrays first, packed into the
worker's staging buffer and sent to the device in one copy (`workers/staging.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.workers.attention import AttentionBackend, AttentionMetadata, build_attention_metadata, token_positions
from tokenmill.workers.grammar_mask import StagedBitmask, stage_bitmask
from tokenmill.workers.lora.manager import LoRAManager
from tokenmill.workers.request_state import CachedRequest, ScheduledRequest
from tokenmill.workers.sampler import SamplingInputs, sampling_inputs
from tokenmill.workers.staging import StepStaging


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
    sampling: SamplingInputs | None = None  # the sampled requests' parameters, staged with the rest; None: none
    grammar: StagedBitmask | None = None  # the grammar bitmask rows of the sampled requests, staged; None: none
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
    staging: StepStaging | None = None  # the step's one host-to-device copy; None: one copy per tensor
    vocab_size: int = 0  # the logits' width (the sampling inputs are staged when set)
    lora: LoRAManager | None = None  # with --enable-lora: the adapters' slots, assigned here once per step

    def prepare(
        self,
        scheduled: Sequence[ScheduledRequest],
        drafts: dict[str, list[int]],
        grammar_request_ids: Sequence[str] = (),
        grammar_bitmask: bytes = b"",
    ) -> StepBatch:
        """The flat batch of `scheduled`; `drafts` (request id -> draft tokens scheduled after its known tokens, this
        step only): such a request is sampled at its last known token and at every draft. The plan's grammar bitmask
        rows (`grammar_request_ids` order) of the requests sampled here travel with the step's inputs."""
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
        return self._staged_batch(
            np.array(input_ids, dtype=np.int64),
            token_positions(query_lens, seq_lens),
            np.array(sample_rows, dtype=np.int64),
            (query_lens, seq_lens, block_tables),
            sampled_requests,
            sampled_drafts if drafts else None,
            (grammar_request_ids, grammar_bitmask),
            self._lora_slots(scheduled, query_lens),
        )

    def _staged_batch(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        sample_rows: np.ndarray,
        shape: tuple[np.ndarray, np.ndarray, np.ndarray],
        sampled_requests: list[CachedRequest],
        drafts: list[list[int]] | None,
        grammar: tuple[Sequence[str], bytes],
        lora_slots: np.ndarray | None,
    ) -> StepBatch:
        """The batch's device tensors, every one packed into the staging buffer, then sent in its one flush."""
        staging = self.staging
        batch = StepBatch(
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            attn=build_attention_metadata(
                *shape,
                self.block_size,
                self.device,
                self.backend,
                self.decode_chunk_tokens,
                self.sliding_windows,
                staging,
            ),
            sample_rows=self._to_device(sample_rows),
            sampled_requests=sampled_requests,
            drafts=drafts,
            lora_slots=None if lora_slots is None else self._to_device(lora_slots),
        )
        if staging is not None:
            states = [request.sampling for request in sampled_requests if request.sampling is not None]
            if self.vocab_size and any(not state.params.greedy for state in states):  # greedy reads none
                batch.sampling = sampling_inputs(states, self.vocab_size, lambda host: staging.upload(host, host.dtype))
            if grammar[0]:
                row_request_ids = [request.request_id for request in sampled_requests]
                batch.grammar = stage_bitmask(grammar[1], grammar[0], row_request_ids, staging.upload)
            staging.flush()
        return batch

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        if self.staging is not None:
            return self.staging.upload(array, torch.int64)
        return torch.from_numpy(array).to(self.device)

    def _lora_slots(self, scheduled: Sequence[ScheduledRequest], query_lens: np.ndarray) -> np.ndarray | None:
        """Every row's adapter slot (the adapters not in a slot are loaded now); None when no request has one."""
        requests = [entry.request.lora_request for entry in scheduled]
        if self.lora is None or all(request is None for request in requests):
            return None
        slots = np.asarray(self.lora.assign_slots(requests), dtype=np.int64)
        return np.repeat(slots, query_lens)


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
        sampling=None,  # the micro-batches' parameters are not joined: the sampler sends the step's own
        grammar=None,
    )
