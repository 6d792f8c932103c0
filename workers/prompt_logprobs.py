"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob under the model, and the top-k alternatives.

They come from the prefill's own forward pass: the hidden state at prompt position p, through the LM head, is the
distribution of token p + 1, so a request that asks gets the LM head over its prompt positions (and only those) in
the steps that compute them. Under chunked prefill each chunk contributes its positions; the last position of a
chunk predicts the first token of the next one, which is known already (the worker holds the whole prompt), so
nothing but the entries so far is carried from chunk to chunk. The prompt's last position predicts the first output
token, sampled as usual: the first prompt token has no logprob.

The logprobs are those of the raw model distribution (float32 log_softmax of the logits), as vLLM's default. Each
chunk's rows are kept as numpy arrays (never a Python object per token); when the prompt completes, rank 0 hands
them over at once, packed (`PromptLogprobs`), with the request's first sampled token.

A prefix-cache hit would leave the cached positions without hidden states, so the scheduler never lets such a request
read the prefix cache (as vLLM V1); a request that resumes after preemption with outputs already generated has had its
prompt logprobs delivered, and computes none again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenmill.messages import NewRequestData, PromptLogprobs

# one chunk's rows of a request: logprobs [R], ranks [R], top ids [R, k], top logprobs [R, k]
ScoredRows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass
class PromptLogprobsState:
    """One request's prompt logprobs, filled chunk by chunk."""

    num_top: int  # top alternatives per position (vLLM's k; -1: the whole vocabulary)
    num_prompt_tokens: int
    chunks: list[ScoredRows] = field(default_factory=list)  # positions 1 .. so far, in order

    def take(self) -> PromptLogprobs:
        """Every position scored so far, packed, and the state emptied."""
        chunks, self.chunks = self.chunks, []
        if not chunks:  # a one-token prompt: nothing to score
            return PromptLogprobs(max(self.num_top, 0))
        return PromptLogprobs.from_arrays(*(np.concatenate(column) for column in zip(*chunks)))


def prompt_logprobs_state(new: NewRequestData) -> PromptLogprobsState | None:
    """The state for a request sent in full, when it asks for prompt logprobs that are still to be delivered."""
    if new.task != "generate" or new.sampling.prompt_logprobs is None:
        return None
    if len(new.token_ids) > new.num_prompt_tokens:
        return None  # resumed after preemption with outputs: its prompt logprobs went out with the first one
    if new.num_computed_tokens > 0:
        raise ValueError(
            f"request {new.request_id} asks for prompt logprobs but {new.num_computed_tokens} of its "
            f"prompt tokens come from the prefix cache, which has no hidden states for them"
        )
    return PromptLogprobsState(new.sampling.prompt_logprobs, new.num_prompt_tokens)


@dataclass
class PromptRows:
    """The flat-batch rows of one step whose hidden states give prompt logprobs, and what they predict."""

    rows: list[int] = field(default_factory=list)  # rows of the step's flat batch
    targets: list[int] = field(default_factory=list)  # the prompt token each row's distribution is scored on
    owners: list[PromptLogprobsState] = field(default_factory=list)  # the request each row belongs to
    completed: list[tuple[str, PromptLogprobsState]] = field(default_factory=list)  # prompts that end this step


def prompt_rows(scheduled: Sequence[tuple[Any, int, int]]) -> PromptRows | None:
    """From a step's scheduled (request, first position, number of tokens), in flat-batch order: the rows that need
    the LM head for prompt logprobs. A request is anything with `request_id`, `token_ids` and `prompt_logprobs` (a
    PromptLogprobsState or None). None when no request in the step asks."""
    found: PromptRows | None = None
    row = 0
    for request, start, num_tokens in scheduled:
        state: PromptLogprobsState | None = request.prompt_logprobs
        if state is not None and start < state.num_prompt_tokens:
            found = found or PromptRows()
            for position in range(start, min(start + num_tokens, state.num_prompt_tokens - 1)):
                found.rows.append(row + position - start)
                found.targets.append(request.token_ids[position + 1])
                found.owners.append(state)
            if start + num_tokens >= state.num_prompt_tokens:
                found.completed.append((request.request_id, state))
        row += num_tokens
    return found


def prompt_logprobs_chunk_rows(max_num_seqs: int) -> int:
    """The most prompt rows one LM-head call scores: it bounds the [rows, vocab] tensors of a step's prompt logprobs
    (as the sampler's own [max_num_seqs, vocab] ones are bounded)."""
    return max(8, max_num_seqs // 2)


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: PromptRows,
    rank: int,
    max_rows: int,
) -> dict[str, PromptLogprobs] | None:
    """Run the LM head over `rows` of `hidden` (at most `max_rows` at a time, bounding the [rows, vocab] tensors) and
    add each row's entry to its request's state. Every tensor-parallel rank must call this (the vocab-parallel LM head
    gathers across them); rank 0 alone scores the rows, and returns the packed rows of the prompts completed this
    step (none for a one-token prompt). Other ranks return None."""
    device = hidden.device
    for begin in range(0, len(rows.rows), max_rows):
        end = min(begin + max_rows, len(rows.rows))
        index = torch.tensor(rows.rows[begin:end], dtype=torch.long).to(device)
        logits = compute_logits(hidden.index_select(0, index))
        if rank != 0:
            continue
        owners = rows.owners[begin:end]
        targets = torch.tensor(rows.targets[begin:end], dtype=torch.long).to(device)
        _score(logits, targets, owners)
    if rank != 0:
        return None
    return {request_id: state.take() for request_id, state in rows.completed}


def _score(logits: torch.Tensor, targets: torch.Tensor, owners: Sequence[PromptLogprobsState]) -> None:
    """Each row's target logprob, its rank and the row owner's top-k, appended to the owner's chunks as arrays."""
    logprobs = logits.float().log_softmax(dim=-1)
    vocab_size = logprobs.shape[1]
    target_logprobs = logprobs.gather(1, targets.unsqueeze(1))  # [R, 1]
    ranks = (logprobs >= target_logprobs).sum(dim=-1, keepdim=True)  # vLLM's rank: 1 + how many are more likely
    ks = [vocab_size if state.num_top < 0 else min(state.num_top, vocab_size) for state in owners]
    num_top = max(ks)
    columns = [target_logprobs.double(), ranks.double()]
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
        columns += [top_ids.double(), top_logprobs.double()]
    # one device-to-host copy for everything: ids and ranks are exact in float64
    table = torch.cat(columns, dim=1).cpu().numpy()
    start = 0
    while start < len(owners):  # a request's rows are consecutive: one slice per request
        state, k = owners[start], ks[start]
        end = start + 1
        while end < len(owners) and owners[end] is state:
            end += 1
        rows = table[start:end]
        state.chunks.append(
            (
                rows[:, 0].astype(np.float32),
                rows[:, 1].astype(np.int32),
                rows[:, 2 : 2 + k].astype(np.int32),
                rows[:, 2 + num_top : 2 + num_top + k].astype(np.float32),
            )
        )
        start = end
