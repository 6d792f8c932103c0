"""The sampler against hand-computed expectations: each logits processor, greedy and filtered sampling, seeded
determinism inside any batch, the sampled distribution, and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.kernels import row_ops
from tokenmill.messages import SamplingParams
from tokenmill.workers.sampler import (
    RequestSamplingState,
    _exponential_noise,
    filter_top_k_top_p_min_p,
    process_logits,
    sample,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NEG_INF = float("-inf")


@pytest.fixture(params=["native", "torch"])
def race_path(request, monkeypatch):
    """The sampled rows' exponential race on the CPU: the native kernel (hashed noise, `row_ops.race_rows`), or the
    torch ops a GPU runs (noise tensor, softmax, divide), the kernel switched off."""
    if request.param == "native":
        if row_ops.library() is None:
            pytest.skip("the CPU row kernels are not built here")
    else:
        monkeypatch.setattr(row_ops, "race_rows", lambda scaled, keys: None)
    return request.param


def make_state(
    device: str = "cpu", prompt: list[int] | None = None, eos: list[int] | None = None, **params
) -> RequestSamplingState:
    return RequestSamplingState(SamplingParams(**params), prompt or [], eos or [], torch.device(device))


def random_logits(rows: int, vocab: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 3).to(device)


# ---------------------------------------------------------------- greedy and its equivalents


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_argmax(device):
    logits = random_logits(6, 50, device)
    result = sample(logits, [make_state(device, temperature=0.0) for _ in range(6)])
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs is None


def test_greedy_rows_mixed_with_random_rows_still_take_the_argmax():
    torch.manual_seed(1)
    logits = random_logits(8, 50)
    states = [make_state(temperature=0.0 if row % 2 == 0 else 1.5) for row in range(8)]
    for _ in range(5):
        token_ids = sample(logits, states).token_ids
        assert token_ids[0::2] == logits[0::2].argmax(dim=-1).tolist()


def test_top_k_1_and_tiny_top_p_equal_greedy():
    torch.manual_seed(2)
    logits = random_logits(5, 40, seed=3)
    expected = logits.argmax(dim=-1).tolist()
    for _ in range(20):
        assert sample(logits, [make_state(temperature=2.0, top_k=1) for _ in range(5)]).token_ids == expected
        assert sample(logits, [make_state(temperature=2.0, top_p=1e-6) for _ in range(5)]).token_ids == expected


def test_sample_leaves_the_callers_logits_untouched():
    logits = random_logits(3, 20)
    before = logits.clone()
    states = [
        make_state(temperature=0.0, logit_bias={1: 5.0}),
        make_state(temperature=1.0, top_k=3, top_p=0.5, repetition_penalty=1.3, prompt=[1, 2]),
        make_state(temperature=0.7, min_p=0.1, min_tokens=2, eos=[4]),
    ]
    sample(logits, states)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- top-k / top-p / min-p filtering


def test_filter_top_k_keeps_the_k_largest_per_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
    filtered = filter_top_k_top_p_min_p(logits, torch.tensor([2, 4]), None, None)
    assert torch.equal(filtered, torch.tensor([[NEG_INF, 4.0, 3.0, NEG_INF], [4.0, 3.0, 2.0, 1.0]]))


def test_filter_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.1, 0.5, 0.15, 0.25], [0.1, 0.5, 0.15, 0.25]])
    logits = probs.log()
    # Sorted masses 0.5, 0.25, 0.15, 0.1: p=0.7 needs 2 tokens, p=0.3 needs 1, p=0.8 needs 3.
    filtered = filter_top_k_top_p_min_p(logits, None, torch.tensor([0.7, 0.3, 0.8]), None)
    kept = torch.isfinite(filtered)
    assert kept.tolist() == [[False, True, False, True], [False, True, False, False], [False, True, True, True]]
    assert torch.allclose(filtered[kept], logits[kept])


def test_filter_min_p_removes_tokens_below_a_fraction_of_the_top_one():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    filtered = filter_top_k_top_p_min_p(logits, None, None, torch.tensor([0.2]))  # threshold 0.2 * 0.5 = 0.1
    assert torch.isfinite(filtered).tolist() == [[True, True, True, False]]


def test_filter_order_top_k_then_top_p_then_min_p():
    # Top-k 3 renormalises [0.4, 0.3, 0.2] to [4/9, 3/9, 2/9]; top-p 0.7 then needs the first two (4/9 < 0.7);
    # min-p 0.8 would cut 3/9 (< 0.8 * 4/9), leaving one.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 2).log()
    top_k = torch.tensor([3, 3])
    filtered = filter_top_k_top_p_min_p(logits, top_k, torch.tensor([0.7, 0.7]), torch.tensor([0.0, 0.8]))
    assert torch.isfinite(filtered).tolist() == [[True, True, False, False], [True, False, False, False]]


def reference_kept(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> list[bool]:
    """A slow, obvious per-row top-k -> top-p -> min-p in float64."""
    values = sorted(row.double().tolist(), reverse=True)[: top_k if top_k > 0 else None]
    total = sum(math.exp(v - values[0]) for v in values)
    probs = [math.exp(v - values[0]) / total for v in values]
    last, mass_before = 0, 0.0
    for index, prob in enumerate(probs):
        if index > 0 and (mass_before >= top_p or prob < min_p * probs[0]):
            break
        last, mass_before = index, mass_before + prob
    return [value >= values[last] for value in row.double().tolist()]


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat rows overrun the CPU candidate shortcut, peaked ones not
def test_filter_matches_a_per_row_reference_on_a_large_vocabulary(scale):
    vocab = 5000
    logits = random_logits(6, vocab, seed=9) * scale
    top_k = [0, 10, 2000, 0, 0, 1500]
    top_p = [0.9, 0.5, 1.0, 0.95, 1.0, 0.8]
    min_p = [0.0, 0.0, 0.1, 0.02, 0.05, 0.0]
    filtered = filter_top_k_top_p_min_p(
        logits,
        torch.tensor([k if k > 0 else vocab for k in top_k]),
        torch.tensor(top_p),
        torch.tensor(min_p),
    )
    for row in range(6):
        expected = reference_kept(logits[row], top_k[row], top_p[row], min_p[row])
        assert torch.isfinite(filtered[row]).tolist() == expected, f"row {row}"
    without_large_k = [0, 1, 3, 4]  # no top_k above the shortcut's candidates: the CPU shortcut may serve them
    rows = torch.tensor(without_large_k)
    k_rows = torch.tensor([top_k[r] if top_k[r] > 0 else vocab for r in without_large_k])
    subset = filter_top_k_top_p_min_p(logits[rows], k_rows, torch.tensor(top_p)[rows], torch.tensor(min_p)[rows])
    assert torch.equal(torch.isfinite(subset), torch.isfinite(filtered[rows]))


def test_filter_always_keeps_the_top_token():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    filtered = filter_top_k_top_p_min_p(logits, torch.tensor([1]), torch.tensor([0.0]), torch.tensor([1.0]))
    assert torch.isfinite(filtered).tolist() == [[True, False, False]]


# ---------------------------------------------------------------- logits processors


def test_logit_bias_is_added_to_its_tokens_only():
    logits = torch.zeros(2, 5)
    states = [make_state(logit_bias={1: 2.5, 3: -1.0, 99: 4.0}), make_state()]
    processed = process_logits(logits, states)
    assert processed.tolist() == [[0.0, 2.5, 0.0, -1.0, 0.0], [0.0] * 5]
    assert sample(logits[:1], [make_state(temperature=0.0, logit_bias={4: 0.5})]).token_ids == [4]


def test_min_tokens_blocks_eos_and_stop_ids_until_enough_outputs():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]])  # eos 2 is the best token, stop id 3 next
    state = make_state(temperature=0.0, min_tokens=2, eos=[2], stop_token_ids=[3])
    assert process_logits(logits, [state]).tolist() == [[0.0, 1.0, NEG_INF, NEG_INF, 7.0]]
    assert sample(logits, [state]).token_ids == [4]
    state.output_token_ids += [4]
    assert sample(logits, [state]).token_ids == [4]
    state.output_token_ids += [4]
    assert sample(logits, [state]).token_ids == [2]


def test_min_tokens_with_ignore_eos_blocks_only_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]])
    state = make_state(temperature=0.0, min_tokens=3, eos=[2], stop_token_ids=[3], ignore_eos=True)
    assert process_logits(logits, [state]).tolist() == [[0.0, 1.0, 9.0, NEG_INF, 7.0]]


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, -2.0, 3.0, 1.0]])
    state = make_state(prompt=[0, 1], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    state.output_token_ids += [2, 2, 3]
    # repetition: seen {0, 1, 2, 3} -> 2/2, -1*2, 0.5/2, -2*2; frequency/presence on outputs {2: 2, 3: 1}
    expected = [1.0, -2.0, 0.25 - 2 * 0.5 - 0.25, -4.0 - 0.5 - 0.25, 3.0, 1.0]
    assert torch.allclose(process_logits(logits, [state]), torch.tensor([expected]))


def test_penalty_counts_follow_appended_outputs_across_steps():
    logits = torch.zeros(3, 4)
    penalized = make_state(frequency_penalty=1.0)
    states = [make_state(), penalized, make_state(presence_penalty=0.5)]
    assert process_logits(logits, states)[1].tolist() == [0.0] * 4
    penalized.output_token_ids += [1]
    states[2].output_token_ids += [3, 3]
    assert process_logits(logits, states).tolist() == [[0.0] * 4, [0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, -0.5]]
    penalized.output_token_ids += [1, 2]
    # the penalized request alone in the next step: its counts carry over
    assert process_logits(logits[:1], [penalized]).tolist() == [[0.0, -2.0, -1.0, 0.0]]


def test_greedy_follows_the_processed_logits():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    state = make_state(temperature=0.0, repetition_penalty=2.0, prompt=[0])  # 5 -> 2.5, so token 1 wins
    assert sample(logits, [state]).token_ids == [1]


# ---------------------------------------------------------------- randomness


def test_same_seed_same_tokens_alone_or_inside_any_batch(race_path):
    vocab = 64
    steps = [random_logits(1, vocab, seed=10 + step) for step in range(6)]

    def run(batch_position: int, batch_size: int, others: dict) -> list[int]:
        torch.manual_seed(batch_size)  # the unseeded neighbours differ between runs
        states = [make_state(**({"temperature": 1.0} | others)) for _ in range(batch_size)]
        states[batch_position] = make_state(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
        tokens = []
        for step_logits in steps:
            batch = random_logits(batch_size, vocab, seed=batch_size)
            batch[batch_position] = step_logits[0]
            token = sample(batch, states).token_ids[batch_position]
            states[batch_position].output_token_ids.append(token)
            tokens.append(token)
        return tokens

    alone = run(0, 1, {})
    assert run(2, 5, {}) == alone
    assert run(0, 4, {"seed": 7, "top_k": 50}) == alone
    assert run(1, 3, {"top_p": 0.5}) == alone  # a full sort instead of a top-20 for the filtered rows
    assert run(3, 4, {"temperature": 0.0}) == alone
    assert len(set(alone)) > 1  # the seeded request really samples


def test_a_seed_fixes_the_stream_and_another_seed_changes_it(race_path):
    logits = torch.zeros(1, 1000)

    def stream(seed: int) -> list[int]:
        state = make_state(seed=seed)
        for _ in range(5):
            state.output_token_ids.append(sample(logits, [state]).token_ids[0])
        return state.output_token_ids

    assert stream(1) == stream(1)
    assert stream(1) != stream(2)
    assert len(set(stream(1))) > 1  # each position draws afresh


def test_a_seeded_request_resumed_after_preemption_continues_its_stream(race_path):
    # The model runner rebuilds a preempted request's state with the outputs it already has; the draw for output
    # position i depends only on (seed, i), so the resumed request samples what it would have had it kept running.
    vocab = 500
    steps = [random_logits(1, vocab, seed=40 + step) for step in range(8)]
    state = make_state(temperature=1.0, seed=77)
    for step_logits in steps:
        state.output_token_ids.append(sample(step_logits, [state]).token_ids[0])
    uninterrupted = state.output_token_ids

    state = make_state(temperature=1.0, seed=77)
    for i, step_logits in enumerate(steps):
        if i in (3, 6):  # preempted, then resumed as a new request carrying its outputs so far
            outputs, state = state.output_token_ids, make_state(temperature=1.0, seed=77)
            state.output_token_ids.extend(outputs)
        state.output_token_ids.append(sample(step_logits, [state]).token_ids[0])
    assert state.output_token_ids == uninterrupted


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "sampled a token of probability zero"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def test_sampled_distribution_matches_softmax_with_temperature(race_path):
    torch.manual_seed(3)
    draws = 40_000
    base = torch.tensor([1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    logits = base.repeat(draws, 1)
    tokens = sample(logits, [make_state(temperature=temperature) for _ in range(draws)]).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    # 3 degrees of freedom: P(chi2 > 25) is about 1.6e-5
    assert chi_square(counts, (base / temperature).softmax(-1)) < 25
    # and it is not simply the temperature-1 distribution
    assert chi_square(counts, base.softmax(-1)) > 100


def test_sampled_distribution_after_top_p_is_renormalised(race_path):
    torch.manual_seed(4)
    draws = 20_000
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().repeat(draws, 1)
    tokens = sample(logits, [make_state(top_p=0.7) for _ in range(draws)]).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    assert chi_square(counts, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8) < 20


def test_seeded_rows_sample_the_right_distribution(race_path):
    # A seeded request's own generator must give an unbiased stream too.
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    state = make_state(seed=99)
    for _ in range(4000):
        state.output_token_ids.append(sample(probs.log().unsqueeze(0), [state]).token_ids[0])
    counts = torch.bincount(torch.tensor(state.output_token_ids), minlength=4).float()
    assert chi_square(counts, probs) < 25


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_come_from_the_raw_logits(device):
    logits = random_logits(3, 30, device, seed=5)
    states = [
        make_state(device, temperature=0.0, logprobs=3, repetition_penalty=100.0, prompt=[int(logits[0].argmax())]),
        make_state(device, temperature=1.0, logprobs=0),
        make_state(device, temperature=0.0),
    ]
    result = sample(logits, states)
    raw = logits.float().log_softmax(-1).cpu()
    assert result.logprobs is not None and len(result.logprobs) == 3
    for row, (token_logprob, _top_ids, _top_logprobs) in enumerate(result.logprobs):
        assert math.isclose(token_logprob, raw[row, result.token_ids[row]].item(), rel_tol=1e-6, abs_tol=1e-6)
    top_ids, top_logprobs = result.logprobs[0][1], result.logprobs[0][2]
    expected_logprobs, expected_ids = raw[0].topk(3)
    assert top_ids == expected_ids.tolist()
    assert torch.allclose(torch.tensor(top_logprobs), expected_logprobs)
    # row 0's repetition penalty changed its pick, but not its logprobs (raw, as vLLM V1)
    assert result.token_ids[0] != top_ids[0]
    assert result.logprobs[1][1:] == ([], [])
    assert result.logprobs[2][1:] == ([], [])


def test_filter_keeps_every_token_tied_with_the_cutoff():
    logits = torch.tensor([[3.0, 2.0, 1.0, 2.0]])
    filtered = filter_top_k_top_p_min_p(logits, torch.tensor([2]), None, None)
    assert torch.isfinite(filtered).tolist() == [[True, True, False, True]]


def test_filter_with_topk_candidates_equals_the_full_sort():
    logits = random_logits(6, 300, seed=8)
    top_k = torch.tensor([5, 20, 40, 40, 1, 33])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.2, 0.99])
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.3, 0.0, 0.01])
    full = filter_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    assert torch.equal(filter_top_k_top_p_min_p(logits, top_k, top_p, min_p, num_candidates=40), full)
    kept = torch.isfinite(full).sum(dim=-1)
    assert kept[0] == 5 and kept[4] == 1 and (kept <= top_k).all() and kept[2] < 40


@pytest.mark.parametrize("seed", [None, 7])
def test_the_race_noise_is_exponential_with_rate_one(seed):
    """The exponential race's q (drawn by inversion of a uniform, faster than torch's CPU exponential_): its mean, its
    tails and its smallest values are those of Exp(1), seeded rows included, and it is never 0."""
    states = [make_state(temperature=1.0, seed=seed) for _ in range(4)]
    noise = _exponential_noise(torch.empty(4, 50_000), states).flatten()
    assert noise.min() > 0 and torch.isfinite(noise).all()
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01)
    for x in (0.01, 1.0, 3.0):
        assert (noise > x).float().mean().item() == pytest.approx(math.exp(-x), rel=0.05)
