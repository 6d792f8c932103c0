"""Batched top-k / top-p / min-p filter against the row-by-row reference and the definitions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.kernels.sampling import filter_logits, filter_logits_ref

VOCAB = 50


def filter_rows(logits, top_k, top_p, min_p):
    return filter_logits(
        logits,
        torch.tensor(top_k, dtype=torch.int32),
        torch.tensor(top_p, dtype=torch.float32),
        torch.tensor(min_p, dtype=torch.float32),
    )


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > float("-inf")).flatten().tolist())


def test_mixed_batch_matches_reference():
    params = [  # (top_k, top_p, min_p) per row: each filter alone, combinations, and all off
        (0, 1.0, 0.0),
        (5, 1.0, 0.0),
        (-1, 0.5, 0.0),
        (0, 1.0, 0.2),
        (10, 0.7, 0.0),
        (10, 0.9, 0.05),
        (VOCAB, 1.0, 0.0),
        (1, 0.3, 0.5),
    ]
    logits = torch.randn(len(params), VOCAB) * 3
    top_k, top_p, min_p = (torch.tensor(column) for column in zip(*params))
    out = filter_logits(logits, top_k.int(), top_p.float(), min_p.float())
    assert torch.equal(out, filter_logits_ref(logits, top_k, top_p, min_p))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[6], logits[6])  # rows with filters off
    assert [len(kept(row)) for row in out[[1, 7]]] == [5, 1]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    top_k=st.lists(st.integers(-1, VOCAB + 2), min_size=1, max_size=4),
    top_p=st.floats(0.0, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_random_parameters_match_reference(seed, top_k, top_p, min_p):
    torch.manual_seed(seed)
    logits = torch.randn(len(top_k), VOCAB) * 2
    rows = len(top_k)
    args = (torch.tensor(top_k, dtype=torch.int32), torch.full((rows,), top_p), torch.full((rows,), min_p))
    assert torch.equal(filter_logits(logits, *args), filter_logits_ref(logits, *args))


def test_definitions():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    probs = logits.softmax(-1)[0]  # ~ [0.012, 0.032, 0.086, 0.234, 0.636]
    assert kept(filter_rows(logits, [2], [1.0], [0.0])[0]) == {3, 4}
    assert kept(filter_rows(logits, [0], [0.6], [0.0])[0]) == {4}  # 0.636 already reaches 0.6
    assert kept(filter_rows(logits, [0], [0.7], [0.0])[0]) == {3, 4}
    assert kept(filter_rows(logits, [0], [0.0], [0.0])[0]) == {4}  # top-p keeps at least one token
    # min-p keeps tokens with prob >= min_p * max prob
    threshold = float(probs[3] / probs[4]) + 1e-3
    assert kept(filter_rows(logits, [0], [1.0], [threshold])[0]) == {4}
    assert kept(filter_rows(logits, [0], [1.0], [threshold - 2e-3])[0]) == {3, 4}
    # top-p runs on the top-k-renormalized distribution: among {2, 3, 4} token 4 holds ~0.665.
    renormalized = probs[2:] / probs[2:].sum()
    assert float(renormalized[-1]) > 0.66
    assert kept(filter_rows(logits, [3], [0.66], [0.0])[0]) == {4}
    assert kept(filter_rows(logits, [0], [0.66], [0.0])[0]) == {3, 4}


def test_ties_at_the_cutoff_are_kept():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    assert kept(filter_rows(logits, [1], [1.0], [0.0])[0]) == {1, 2, 4}
    assert torch.equal(
        filter_rows(logits, [1], [1.0], [0.0]),
        filter_logits_ref(logits, torch.tensor([1]), torch.tensor([1.0]), torch.tensor([0.0])),
    )


def test_empty_batch_and_half_precision_logits():
    empty = filter_rows(torch.empty(0, VOCAB), [], [], [])
    assert empty.shape == (0, VOCAB)
    logits = torch.randn(3, VOCAB).half()
    out = filter_rows(logits, [4, 0, 0], [1.0, 0.5, 1.0], [0.0, 0.0, 0.1])
    assert out.dtype == torch.float16
    args = (torch.tensor([4, 0, 0]), torch.tensor([1.0, 0.5, 1.0]), torch.tensor([0.0, 0.0, 0.1]))
    assert torch.equal(out, filter_logits_ref(logits, *args))
