"""What the worker remembers about each request between steps, and applying a StepPlan's diff to it.

A StepPlan is a diff: finished requests are forgotten, new ones arrive in full, running ones bring the tokens
sampled last step and any new blocks. Under overlap scheduling the scheduler plans a step before it has seen the
previous step's tokens: a running request then says so (`append_last_sampled`), and the worker appends the token it
sampled for it last step, kept here (`record_sampled`). Applying a plan yields the step's `ScheduledRequest`s in
flat-batch order, each contributing `num_scheduled_tokens` tokens from `num_computed_tokens`: the single-token
requests (decodes) first, then the others, each in plan order (vLLM's `reorder_batch`), so a mixed step's decode rows
and prefill rows are two contiguous slices and the Triton backend runs each through its own kernel
(`workers/triton_backend.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tokenmill.messages import LoRARequest, NewRequestData, StepPlan
from tokenmill.workers.prompt_logprobs import PromptLogprobsState, prompt_logprobs_state
from tokenmill.workers.sampler import RequestSamplingState


@dataclass
class CachedRequest:
    """One request as the worker holds it between steps."""

    request_id: str
    token_ids: list[int]  # prompt + outputs known so far
    block_ids: list[int]
    task: str
    sampling: RequestSamplingState | None  # None for embedding requests
    prompt_logprobs: PromptLogprobsState | None = None  # while its prompt logprobs are being computed
    lora_request: LoRARequest | None = None  # its LoRA adapter; None: the base model


class ScheduledRequest(NamedTuple):
    """One request's share of a step: `num_scheduled_tokens` tokens from position `num_computed_tokens`."""

    request: CachedRequest
    num_computed_tokens: int
    num_scheduled_tokens: int


class RequestStates:
    """Every request the worker holds, kept in step with the scheduler's plans."""

    def __init__(self, eos_token_ids: list[int], device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.requests: dict[str, CachedRequest] = {}
        self.last_sampled: dict[str, int] = {}  # request id -> its newest token sampled in the last step

    def apply(self, plan: StepPlan, blocks_handed_out: Callable[[list[int]], None]) -> list[ScheduledRequest]:
        """Forget, add and extend requests as `plan` says; the requests with tokens this step, in batch order.

        `blocks_handed_out` hears of every block id the plan hands out (the KV cache zeroes the ones never used)."""
        for request_id in plan.finished_ids:
            self.requests.pop(request_id, None)
        scheduled: list[ScheduledRequest] = []
        handed_out: list[int] = []
        for new in plan.new_requests:
            handed_out.extend(new.block_ids)
            scheduled.append(ScheduledRequest(self._add(new), new.num_computed_tokens, new.num_scheduled_tokens))
        last_sampled, self.last_sampled = self.last_sampled, {}
        for running in plan.running:
            request = self.requests[running.request_id]
            request.token_ids.extend(running.new_token_ids)
            if running.append_last_sampled:
                request.token_ids.append(_sampled_last_step(last_sampled, running.request_id))
            request.block_ids.extend(running.new_block_ids)
            handed_out.extend(running.new_block_ids)
            scheduled.append(ScheduledRequest(request, running.num_computed_tokens, running.num_scheduled_tokens))
        if handed_out:
            blocks_handed_out(handed_out)
        return decode_first([entry for entry in scheduled if entry.num_scheduled_tokens > 0])

    def record_sampled(self, requests: list[CachedRequest], new_token_ids: list[list[int]]) -> None:
        """Remember each sampled request's newest token, for a next plan made before the scheduler saw it."""
        self.last_sampled = {request.request_id: tokens[-1] for request, tokens in zip(requests, new_token_ids)}

    def _add(self, new: NewRequestData) -> CachedRequest:
        sampling = None
        if new.task == "generate":
            prompt = new.token_ids[: new.num_prompt_tokens]
            sampling = RequestSamplingState(new.sampling, prompt, self.eos_token_ids, self.device)
            sampling.output_token_ids.extend(new.token_ids[new.num_prompt_tokens :])  # resumed after preemption
        request = CachedRequest(new.request_id, list(new.token_ids), list(new.block_ids), new.task, sampling)
        request.lora_request = new.lora_request
        request.prompt_logprobs = prompt_logprobs_state(new)
        self.requests[new.request_id] = request
        return request


def decode_first(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """`scheduled` with its one-token requests first (a stable sort: each group keeps its order)."""
    return sorted(scheduled, key=lambda entry: entry.num_scheduled_tokens != 1)


def _sampled_last_step(last_sampled: dict[str, int], request_id: str) -> int:
    if request_id not in last_sampled:
        raise ValueError(f"request {request_id}: the plan appends its last sampled token, but none was sampled")
    return last_sampled[request_id]


def plan_drafts(plan: StepPlan) -> dict[str, list[int]]:
    """Speculative decoding: request id -> the draft tokens the plan schedules after its known tokens."""
    return {running.request_id: running.spec_token_ids for running in plan.running if running.spec_token_ids}
