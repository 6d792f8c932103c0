"""The structured-output bitmask on the worker: exactly the disallowed logits become -inf, on the right rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.workers.backends import cpu_kernels_enabled
from tokenmill.workers.grammar_mask import allowed_tokens, apply_grammar_bitmask


def pack(allowed: np.ndarray) -> bytes:
    """[R, V] bool -> int32 words, bit t of row r set when token t is allowed (llguidance's layout)."""
    rows, vocab = allowed.shape
    words = np.zeros((rows, -(-vocab // 32)), dtype=np.uint32)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].astype(np.uint32) << np.uint32(t % 32)
    return words.view(np.int32).tobytes()


def test_unpacking_matches_the_bits_including_the_sign_bit():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 100)) < 0.3
    allowed[:, 31] = True  # bit 31 is the int32 sign bit
    unpacked = allowed_tokens(pack(allowed), 3, 100, torch.device("cpu"))
    assert torch.equal(unpacked, torch.from_numpy(allowed))


def test_only_constrained_rows_are_masked_and_ids_past_the_mask_are_disallowed():
    rng = np.random.default_rng(1)
    vocab_in_mask, vocab = 70, 80  # the logits are wider than the tokenizer the grammar knows
    allowed = rng.random((2, vocab_in_mask)) < 0.5
    logits = torch.randn(3, vocab, dtype=torch.bfloat16)
    original = logits.clone()
    # rows of the batch: a, b, c; the grammar constrains c and a (in that order)
    masked = apply_grammar_bitmask(logits, ["a", "b", "c"], ["c", "a"], pack(allowed))
    assert masked.dtype == torch.float32
    expected = original.float()
    for grammar_row, batch_row in ((0, 2), (1, 0)):
        disallowed = torch.ones(vocab, dtype=torch.bool)
        disallowed[:vocab_in_mask] = ~torch.from_numpy(allowed[grammar_row])
        expected[batch_row, disallowed] = float("-inf")
    assert torch.equal(masked, expected)
    assert torch.equal(masked[1], original[1].float())  # b is unconstrained


def test_a_row_that_allows_nothing_is_left_alone_and_absent_requests_are_ignored():
    logits = torch.randn(2, 40)
    allowed = np.zeros((2, 40), dtype=bool)
    allowed[1, 5] = True
    masked = apply_grammar_bitmask(logits.clone(), ["a", "b"], ["a", "gone"], pack(allowed))
    assert torch.equal(masked, logits)  # a allows nothing (left to the scheduler); "gone" samples nothing here
    masked = apply_grammar_bitmask(logits.clone(), ["a", "b"], ["gone", "b"], pack(allowed))
    assert masked[1].argmax().item() == 5 and torch.isinf(masked[1]).sum().item() == 39


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_the_cpu_kernel_and_the_torch_code_agree(kernels, monkeypatch):
    if kernels == "torch":
        monkeypatch.setattr("tokenmill.workers.grammar_mask.cpu_kernels_enabled", lambda: False)
    elif not cpu_kernels_enabled():
        pytest.fail("the CPU kernels did not build on this machine")
    rng = np.random.default_rng(3)
    allowed = rng.random((5, 1000)) < 0.2
    allowed[2] = False  # allows nothing: left alone
    allowed[3] = True  # allows everything within the bitmask
    logits = torch.randn(6, 1010)
    grammar_ids = ["r4", "r0", "r2", "r5", "r3"]
    masked = apply_grammar_bitmask(logits.clone(), [f"r{i}" for i in range(6)], grammar_ids, pack(allowed))
    expected = logits.clone()
    for mask_row, request_id in enumerate(grammar_ids):
        if not allowed[mask_row].any():
            continue
        disallowed = torch.ones(1010, dtype=torch.bool)
        disallowed[:1000] = ~torch.from_numpy(allowed[mask_row])
        expected[int(request_id[1:]), disallowed] = float("-inf")
    assert torch.equal(masked, expected)
