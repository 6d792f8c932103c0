"""The reduced-precision greedy comparison (`assert_greedy_close`, vLLM's check_logprobs_close rule)."""

from __future__ import annotations

import pytest

from tests.helpers.reference import assert_greedy_close

REFERENCE = [(5, [5, 9, 2]), (7, [7, 1, 3]), (4, [4, 8, 6])]  # (greedy token, the reference's top ids)


def test_equal_tokens_are_all_compared():
    assert assert_greedy_close([5, 7, 4], [[5], [7], [4]], REFERENCE) == 3


def test_a_difference_inside_both_top_lists_stops_the_comparison():
    # step 1: ours 1 is the reference's second, the reference's 7 is in our top; what follows is not compared
    assert assert_greedy_close([5, 1, 99], [[5], [1, 7], [99]], REFERENCE) == 2


def test_a_difference_outside_the_references_top_fails():
    with pytest.raises(AssertionError, match="token 1 differs beyond the top 3"):
        assert_greedy_close([5, 42, 4], [[5], [42, 7], [4]], REFERENCE)


def test_a_difference_outside_our_top_fails():
    with pytest.raises(AssertionError, match="our top"):
        assert_greedy_close([5, 1, 4], [[5], [1, 3], [4]], REFERENCE)


def test_a_short_output_fails_unless_only_the_final_eos_is_missing():
    assert assert_greedy_close([5, 7], [[5], [7]], REFERENCE) == 2
    with pytest.raises(AssertionError, match="stopped after 1 tokens"):
        assert_greedy_close([5], [[5]], REFERENCE)
