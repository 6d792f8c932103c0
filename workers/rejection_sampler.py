"""Verify draft tokens against the target model: keep exactly the target's distribution, accept as many as that allows.

Deterministic drafts (n-gram: the proposal q is a point mass on the draft d) are verified by sampling, from the
target's logits at every draft position, the token the ordinary sampler would pick there (`sample` with the row's
output position, so a seeded request draws the noise it would draw without speculation), and accepting drafts while
they equal those tokens; the first token that differs, or the token after the last draft, is the step's last token.
This is the accept/resample rule of Leviathan et al. / Chen et al. for a point-mass q: d is accepted with probability
p(d), and on rejection the token is distributed as p restricted to tokens other than d, renormalised, i.e.
norm(max(0, p - q)). Greedy rows compare drafts with the argmax. Because every kept token is the token the
sampler would have produced at that position anyway, speculation changes no output: greedy and seeded requests give
the same tokens with and without it, whatever else shares the batch.

Drafts with a proposal distribution (a draft model) use `rejection_sample`: accept d with probability
min(1, p(d) / q(d)), on rejection resample from norm(max(0, p - q)), after k accepted drafts sample a bonus token
from p. Its uniforms come from the request's seed and output position, as the sampler's noise does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.workers.sampler import RequestSamplingState, position_seed, sample

# rejection_sample's draws for a seeded request come from a stream of their own: (seed ^ this, position)
_REJECTION_SEED_SALT = 0x5EC0DE


class _DraftPositionState:
    """A request's sampling state as seen from draft position j >= 1 of a verification: the same parameters and
    generator, `j` more output tokens (only their count is read: the sampler's min_tokens check and the position
    seed; requests with penalties, which read the tokens themselves, never speculate)."""

    __slots__ = ("params", "generator", "output_token_ids", "min_tokens_blocked_ids", "needs_penalties")

    def __init__(self, state: RequestSamplingState, offset: int) -> None:
        if state.needs_penalties:
            raise ValueError("a request with presence/frequency/repetition penalties cannot verify drafts")
        self.params = state.params
        self.generator = state.generator
        self.output_token_ids = range(len(state.output_token_ids) + offset)
        self.min_tokens_blocked_ids = state.min_tokens_blocked_ids
        self.needs_penalties = False


def verify_point_mass_drafts(
    logits: torch.Tensor, states: Sequence[RequestSamplingState], drafts: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Per request, the tokens the step produced: its accepted drafts, then one sampled token (1 to len(draft) + 1).

    `logits` has len(drafts[r]) + 1 consecutive rows per request r, in order: the rows at its last known token and
    at each draft. A request without drafts has one row and gets the one token `sample` draws for it.
    """
    row_states: list = []
    for state, request_drafts in zip(states, drafts, strict=True):
        row_states.append(state)
        row_states.extend(_DraftPositionState(state, j) for j in range(1, len(request_drafts) + 1))
    if logits.shape[0] != len(row_states):
        raise ValueError(f"logits have {logits.shape[0]} rows, the drafts need {len(row_states)}")
    sampled = sample(logits, row_states).token_ids
    tokens: list[list[int]] = []
    row = 0
    for request_drafts in drafts:
        num_accepted = 0
        while num_accepted < len(request_drafts) and sampled[row + num_accepted] == request_drafts[num_accepted]:
            num_accepted += 1
        tokens.append(sampled[row : row + num_accepted + 1])
        row += len(request_drafts) + 1
    return tokens


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: Sequence[int],
    seed: int | None = None,
    position: int = 0,
) -> list[int]:
    """One request's verification against a proposal distribution: its accepted drafts, then one more token.

    target_probs [k + 1, V]: the target's (processed: temperature, top-k/p, min-p) distribution at the last known
    token and at each draft; draft_probs [k, V]: the proposal each draft was sampled from. A seeded request
    (`seed`, with `position` its number of outputs so far) draws from its own generator re-seeded per position, so
    the same seed gives the same tokens whatever else is in the batch; unseeded draws use torch's global generator.
    """
    num_drafts = len(draft_token_ids)
    if target_probs.shape[0] != num_drafts + 1 or draft_probs.shape[0] != num_drafts:
        raise ValueError(
            f"{num_drafts} drafts need {num_drafts + 1} target rows and {num_drafts} draft rows, got "
            f"{target_probs.shape[0]} and {draft_probs.shape[0]}"
        )
    target_probs = target_probs.double()
    draft_probs = draft_probs.double()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=target_probs.device)

    def draw_uniform(pos: int) -> float:
        if generator is not None:
            generator.manual_seed(position_seed(seed ^ _REJECTION_SEED_SALT, pos))
        return float(torch.rand((), dtype=torch.float64, generator=generator, device=target_probs.device))

    def draw_from(probs: torch.Tensor, pos: int) -> int:
        if generator is not None:
            generator.manual_seed(position_seed(seed ^ _REJECTION_SEED_SALT, pos) ^ 1)
        return int(torch.multinomial(probs, 1, generator=generator))

    accepted: list[int] = []
    for j, draft in enumerate(draft_token_ids):
        p, q = float(target_probs[j, draft]), float(draft_probs[j, draft])
        # accept with probability min(1, p / q): u * q < p for u ~ U[0, 1)
        if draw_uniform(position + j) * q < p:
            accepted.append(int(draft))
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp_min_(0.0)
        total = float(residual.sum())
        accepted.append(draw_from(residual / total if total > 0 else target_probs[j], position + j))
        return accepted
    accepted.append(draw_from(target_probs[num_drafts], position + num_drafts))
    return accepted
