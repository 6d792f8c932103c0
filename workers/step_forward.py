"""How a step's forward runs, chosen once when the worker starts: eagerly, by replaying a captured decode CUDA graph
(eager for the steps no graph fits), or as micro-batches through pipeline stages.

Each mode takes the step's scheduled requests and the function that prepares a batch of them, and returns the
step's `StepBatch` with the final hidden states (None on a pipeline stage before the last).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tokenmill.workers.cuda_graphs import DecodeGraphs
from tokenmill.workers.draft_proposer import DraftModel
from tokenmill.workers.kv_cache import PagedKVCache
from tokenmill.workers.lora.manager import LoRAManager
from tokenmill.workers.models.layers import TensorParallel
from tokenmill.workers.models.pipeline import PipelineStage
from tokenmill.workers.pipeline_parallel import pipelined_forward
from tokenmill.workers.request_state import ScheduledRequest
from tokenmill.workers.step_inputs import StepBatch

PrepareInputs = Callable[[Sequence[ScheduledRequest]], StepBatch]


class StepForward(Protocol):
    def __call__(
        self, scheduled: Sequence[ScheduledRequest], prepare: PrepareInputs
    ) -> tuple[StepBatch, torch.Tensor | None]: ...


class SingleStageForward:
    """The whole model on this rank: a captured decode graph when one fits the batch, else eagerly; a draft model
    then fills its KV for the same tokens (the draft ignores LoRA adapters: only the target's layers have slots)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        draft: DraftModel | None,
        graphs: DecodeGraphs | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.draft = draft
        self.graphs = graphs
        self.lora = lora

    def __call__(
        self, scheduled: Sequence[ScheduledRequest], prepare: PrepareInputs
    ) -> tuple[StepBatch, torch.Tensor | None]:
        batch = prepare(scheduled)
        if self.graphs is not None and self.graphs.can_run(batch.attn):
            if self.lora is not None:  # the recorded LoRA kernel calls read the step's slots from fixed buffers
                self.lora.stage_recorded_step(batch.lora_slots)
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.attn)
        else:
            if self.lora is not None:
                self.lora.begin_step(batch.lora_slots)
            hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_cache.layers)
        if self.draft is not None:  # the draft's KV for the same tokens, in its own caches
            self.draft.fill(batch.input_ids, batch.positions, batch.attn)
        return batch, hidden


class PipelinedStageForward:
    """This stage's layers over the step's micro-batches (`workers/pipeline_parallel.py`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        pp: PipelineStage,
        tp: TensorParallel,
        dtype: torch.dtype,
        hidden_size: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.pp = pp
        self.tp = tp
        self.dtype = dtype
        self.hidden_size = hidden_size

    def __call__(
        self, scheduled: Sequence[ScheduledRequest], prepare: PrepareInputs
    ) -> tuple[StepBatch, torch.Tensor | None]:
        return pipelined_forward(
            self.model, self.pp, self.tp, self.kv_cache.layers, scheduled, prepare, self.dtype, self.hidden_size
        )
