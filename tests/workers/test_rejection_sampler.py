"""The rejection sampler keeps the target's distribution exactly: greedy verification accepts while drafts equal the
argmax; sampled verification is checked with chi-square tests over many seeds against a known distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenmill.messages import SamplingParams
from tokenmill.workers.rejection_sampler import rejection_sample, verify_point_mass_drafts
from tokenmill.workers.sampler import RequestSamplingState, sample

VOCAB = 6
P = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05], dtype=torch.float64)  # the target's distribution, known
Q = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1], dtype=torch.float64)  # a draft model's, different
NUM_SEEDS = 3000
P_VALUE_FLOOR = 1e-4  # a correct sampler fails this once in 10,000 runs


def state(**params) -> RequestSamplingState:
    return RequestSamplingState(SamplingParams(**params), [1, 2, 3], [5], "cpu")


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_accepts_while_drafts_equal_the_argmax():
    states = [state(temperature=0.0), state(temperature=0.0), state(temperature=0.0)]
    # request 0: drafts [1, 2, 3], target argmaxes 1, 2, 4, (0): two accepted, then 4
    # request 1: no drafts: one token; request 2: drafts [3, 3], all accepted, then the bonus token 0
    logits = one_hot_logits([1, 2, 4, 0] + [2] + [3, 3, 0])
    tokens = verify_point_mass_drafts(logits, states, [[1, 2, 3], [], [3, 3]])
    assert tokens == [[1, 2, 4], [2], [3, 3, 0]]
    rejected_first = verify_point_mass_drafts(one_hot_logits([4, 1]), [state(temperature=0.0)], [[1]])
    assert rejected_first == [[4]]


def test_min_tokens_applies_at_each_draft_position():
    """EOS (5) is blocked while fewer than min_tokens outputs exist, counting the drafts before the position."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 5.0
    logits[:, 1] = 4.0
    # no outputs yet, min_tokens=2: positions 0 and 1 may not end, position 2 may
    assert verify_point_mass_drafts(logits, [state(temperature=0.0, min_tokens=2)], [[1, 1]]) == [[1, 1, 5]]


def test_seeded_verification_gives_the_tokens_sampling_alone_gives():
    """A seeded request draws the same noise at each output position with or without drafts, so verifying drafts
    that are the tokens plain sampling produced accepts them all, and other drafts change nothing either."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    plain_state = state(temperature=0.8, top_p=0.9, seed=1234)
    plain = []
    for row in range(5):
        token = sample(logits[row : row + 1], [plain_state]).token_ids[0]
        plain_state.output_token_ids.append(token)
        plain.append(token)
    assert verify_point_mass_drafts(logits, [state(temperature=0.8, top_p=0.9, seed=1234)], [plain[:4]]) == [plain]
    wrong = [(plain[0] + 1) % 50] + plain[1:4]
    assert verify_point_mass_drafts(logits, [state(temperature=0.8, top_p=0.9, seed=1234)], [wrong]) == [plain[:1]]


def first_token_counts(draw) -> np.ndarray:
    counts = np.zeros(VOCAB)
    for seed in range(NUM_SEEDS):
        counts[draw(seed)] += 1
    return counts


def test_point_mass_drafts_keep_the_target_distribution():
    """n-gram drafts (q a point mass on token 1, the target's most likely) over many seeds: the first token's
    distribution is p; and the acceptance rate is p(draft)."""
    # one batch of NUM_SEEDS requests (also checks rows of different requests stay apart)
    logits = P.log().float().repeat(3 * NUM_SEEDS, 1)
    states = [state(temperature=1.0, seed=seed) for seed in range(NUM_SEEDS)]
    first = [tokens[0] for tokens in verify_point_mass_drafts(logits, states, [[1, 3]] * NUM_SEEDS)]
    counts = np.bincount(first, minlength=VOCAB)
    assert chisquare(counts, P.numpy() * NUM_SEEDS).pvalue > P_VALUE_FLOOR
    assert abs(counts[1] / NUM_SEEDS - 0.4) < 0.04  # the draft's acceptance rate is p(draft)


def test_point_mass_verification_distribution_is_wrong_if_always_accepted():
    """The test above can fail: accepting the draft whenever p(draft) > 0 is far from p."""
    counts = np.zeros(VOCAB)
    counts[1] = NUM_SEEDS
    assert chisquare(counts, P.numpy() * NUM_SEEDS).pvalue < P_VALUE_FLOOR


@pytest.mark.parametrize("position", [0, 1])
def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution(position):
    """Drafts sampled from q, verified by accept-min(1, p/q)-or-resample: the token at each position follows p."""
    target = torch.stack([P, P.flip(0), P])  # a different target at the second position
    draft = torch.stack([Q, Q])
    generator = torch.Generator()

    def draw(seed: int) -> int:
        generator.manual_seed(10_000 + seed)
        drafts = [int(torch.multinomial(Q, 1, generator=generator)) for _ in range(2)]
        tokens = rejection_sample(target, draft, drafts, seed=seed)
        if position == 1 and len(tokens) < 2:
            return -1
        return tokens[position]

    if position == 0:
        counts = first_token_counts(draw)
        assert chisquare(counts, P.numpy() * NUM_SEEDS).pvalue > P_VALUE_FLOOR
    else:  # the second token, given the first draft was accepted, follows the second row of the target
        counts = np.zeros(VOCAB)
        for seed in range(NUM_SEEDS):
            token = draw(seed)
            if token >= 0:
                counts[token] += 1
        expected = P.flip(0).numpy() * counts.sum()
        assert chisquare(counts, expected).pvalue > P_VALUE_FLOOR


def test_rejection_sampling_is_deterministic_per_seed():
    target = torch.stack([P, P, P])
    draft = torch.stack([Q, Q])
    assert rejection_sample(target, draft, [2, 0], seed=7) == rejection_sample(target, draft, [2, 0], seed=7)
    assert rejection_sample(target, draft, [1, 1], seed=7, position=3) == rejection_sample(
        target, draft, [1, 1], seed=7, position=3
    )
