"""The sample stage of a step: LM head over the rows to sample, grammar mask, verify drafts or sample, propose drafts.

Every tensor-parallel rank of the last pipeline stage runs it: the vocab-parallel LM head gathers its logits from all
of them, and a sharded draft model proposes on all of them. Rank 0 alone masks, verifies and samples; the tokens it
chose reach the other ranks in one broadcast just before the draft proposes (`propose_drafts`), the one collective
of this stage besides the LM head's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.messages import StepPlan
from tokenmill.workers.distributed import broadcast_from_group_leader
from tokenmill.workers.draft_proposer import DraftModel
from tokenmill.workers.grammar_mask import apply_grammar_bitmask
from tokenmill.workers.models.layers import TensorParallel
from tokenmill.workers.rejection_sampler import verify_point_mass_drafts
from tokenmill.workers.request_state import CachedRequest
from tokenmill.workers.sampler import RequestSamplingState, sample
from tokenmill.workers.step_inputs import StepBatch

Logprobs = list[tuple[float, list[int], list[float]]]


@dataclass
class SampledTokens:
    """What rank 0 chose for a step's sampled requests, aligned with `StepBatch.sampled_requests`."""

    new_token_ids: list[list[int]]  # per request its new tokens: the sampled one, or 1 + its accepted drafts
    verified_drafts: bool  # drafts were verified this step (the scheduler then reads every new token)
    logprobs: Logprobs | None = None
    draft_token_ids: list[list[int]] | None = None  # a draft model's proposals after each request's newest token


class SampleStage:
    """Logits to tokens for one worker; `run` is the whole stage."""

    def __init__(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        rank: int,
        tp: TensorParallel,
        device: torch.device,
        draft: DraftModel | None,
    ) -> None:
        self.compute_logits = compute_logits
        self.rank = rank
        self.tp = tp
        self.device = device
        self.draft = draft

    def run(self, plan: StepPlan, batch: StepBatch, hidden: torch.Tensor) -> SampledTokens | None:
        """Rank 0's tokens (and drafts) for the step's sampled requests; None on other ranks or with none to sample."""
        if not batch.sampled_requests:
            return None
        logits = self.compute_logits(hidden.index_select(0, batch.sample_rows))  # every rank: the head gathers
        sampled = self._choose_tokens(plan, batch, logits) if self.tp.rank == 0 else None
        draft_token_ids = self.propose_drafts(batch.sampled_requests, sampled)
        if sampled is not None:
            sampled.draft_token_ids = draft_token_ids
        return sampled

    def _choose_tokens(self, plan: StepPlan, batch: StepBatch, logits: torch.Tensor) -> SampledTokens:
        """Grammar mask, then verify the drafts (speculative decoding) or sample one token per request."""
        if plan.grammar_request_ids:
            logits = apply_grammar_bitmask(
                logits,
                [request.request_id for request in batch.sampled_requests],
                plan.grammar_request_ids,
                plan.grammar_bitmask,
                batch.grammar,
            )
        states = sampling_states(batch.sampled_requests)
        if batch.drafts is not None:  # verify every draft in the rows after its request's
            accepted = verify_point_mass_drafts(logits, states, batch.drafts)
            for state, token_ids in zip(states, accepted):
                state.output_token_ids.extend(token_ids)
            return SampledTokens(accepted, verified_drafts=True)
        result = sample(logits, states, batch.sampling)
        for state, token_id in zip(states, result.token_ids):
            state.output_token_ids.append(token_id)
        return SampledTokens(
            [[token_id] for token_id in result.token_ids], verified_drafts=False, logprobs=result.logprobs
        )

    def propose_drafts(self, requests: list[CachedRequest], sampled: SampledTokens | None) -> list[list[int]] | None:
        """With a draft model, its proposals after each request's new tokens (they reach the request's token list
        with the next plan); None without one. Every tensor-parallel rank calls this (the draft's layers
        all-reduce); the ranks without `sampled` receive the new tokens from rank 0."""
        if self.draft is None:
            return None
        counts, last_tokens = self._share_new_tokens(sampled, len(requests))
        positions = [len(request.token_ids) + count - 1 for request, count in zip(requests, counts)]
        return self.draft.propose(last_tokens, positions, [request.block_ids for request in requests])

    def _share_new_tokens(self, sampled: SampledTokens | None, num: int) -> tuple[list[int], list[int]]:
        """(how many, the newest) of each request's new tokens, on every tensor-parallel rank (one small int64
        tensor broadcast from rank 0; no collective on one rank)."""
        if self.tp.size == 1:
            assert sampled is not None  # rank 0 of one rank
            return [len(tokens) for tokens in sampled.new_token_ids], [tokens[-1] for tokens in sampled.new_token_ids]
        shared = torch.zeros(2 * num, dtype=torch.int64)
        if sampled is not None:
            shared[:num] = torch.tensor([len(tokens) for tokens in sampled.new_token_ids], dtype=torch.int64)
            shared[num:] = torch.tensor([tokens[-1] for tokens in sampled.new_token_ids], dtype=torch.int64)
        values: list[int] = broadcast_from_group_leader(shared.to(self.device), self.rank, self.tp).tolist()
        return values[:num], values[num:]


def sampling_states(requests: list[CachedRequest]) -> list[RequestSamplingState]:
    """The sampling states of sampled requests (every one has one: only generate requests are sampled)."""
    states = [request.sampling for request in requests if request.sampling is not None]
    if len(states) != len(requests):
        raise ValueError("a request without sampling state was scheduled for sampling")
    return states
