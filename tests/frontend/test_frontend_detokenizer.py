"""Incremental detokenization against full decodes, stop strings across token boundaries, and streaming hold-back."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.messages import SamplingParams

PROMPT = "Tell me something."
MULTILINGUAL = ["naïve café 😀 déjà vu", "你好，世界！🌍🚀", "Ça coûte 5 € — très cher 👍🏽", "🧑‍🤝‍🧑 ẞ ω ∑ ∫ 𝔘𝔫𝔦"]


def full_decode(tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(
    tokenizer,
    ids: list[int],
    params: SamplingParams,
    rng: random.Random | None = None,
    stop_token_id: int | None = None,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `ids` in chunks (random sizes with rng, else one by one); return the released pieces."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), params)
    pieces, i = [], 0
    while i < len(ids) and not detok.finished:
        size = rng.randint(1, 3) if rng else 1
        chunk, i = ids[i : i + size], i + size
        last = i >= len(ids)
        pieces.append(detok.update(chunk, last, stop_token_id if last else None).text)
    return pieces, detok


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_full_decode(tokenizer, skip_special_tokens):
    rng = random.Random(1234)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        pieces, detok = stream(tokenizer, ids, params, rng)
        assert "".join(pieces) == full_decode(tokenizer, ids, skip_special_tokens)
        assert detok.output_text == "".join(pieces)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multibyte_characters_never_emit_broken_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids), "the text should split characters"
    pieces, _ = stream(tokenizer, ids, SamplingParams())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_tokens_skipped_or_rendered(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert 1 in ids and 2 in ids
    skipped, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=True))
    kept, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(skipped) == "assistant\nHi"
    assert "".join(kept) == "<|im_start|>assistant\nHi<|im_end|>"


def test_stop_token_is_not_rendered_unless_asked(tokenizer):
    stop_id = tokenizer.encode(" world")[0]
    ids = tokenizer.encode("Hello") + [stop_id]
    for skip in (True, False):
        hidden, _ = stream(
            tokenizer, ids, SamplingParams(stop_token_ids=[stop_id], skip_special_tokens=skip), stop_token_id=stop_id
        )
        assert "".join(hidden) == "Hello"
    shown, _ = stream(
        tokenizer, ids, SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=True), stop_token_id=stop_id
    )
    assert "".join(shown) == "Hello world"


def test_stop_string_across_token_boundaries(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text)
    stop = "own fox ju"  # starts inside " brown", spans " fox", ends inside " jumps"
    pieces, detok = stream(tokenizer, ids, SamplingParams(stop=[stop]))
    assert detok.stop_string == stop
    assert "".join(pieces) == "The quick br"
    pieces, detok = stream(tokenizer, ids, SamplingParams(stop=[stop], include_stop_str_in_output=True))
    assert "".join(pieces) == "The quick brown fox ju"


def test_first_completed_stop_string_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    pieces, detok = stream(tokenizer, ids, SamplingParams(stop=["delta", "beta", "a b"]))
    assert detok.stop_string == "a b"  # completed at "alpha b", before "beta" ends
    assert "".join(pieces) == "alph"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = [tokenizer.encode(word)[0] for word in ["Hi", ".", " Yes", ".", " No", "."]]
    assert "".join(stream(tokenizer, ids, SamplingParams(stop=["."]))[0]) == "Hi"
    # as vLLM: a stop string counts only once the output has more than min_tokens tokens
    pieces, detok = stream(tokenizer, ids, SamplingParams(stop=["."], min_tokens=2))
    assert detok.stop_string == "." and "".join(pieces) == "Hi. Yes"
    pieces, detok = stream(tokenizer, ids, SamplingParams(stop=["."], min_tokens=4))
    assert "".join(pieces) == "Hi. Yes. No"
    pieces, detok = stream(tokenizer, ids, SamplingParams(stop=["."], min_tokens=6))
    assert detok.stop_string is None and "".join(pieces) == "Hi. Yes. No."


def test_hold_back_releases_nothing_that_could_start_a_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["bar"]))
    released = [detok.update(tokenizer.encode(piece)).text for piece in ["foo", " b", "a"]]
    assert released[0] == "f"  # "oo" held: len("bar") - 1 characters
    assert "".join(released) == "foo "  # "ba" could begin "bar": held
    final = detok.update(tokenizer.encode("z"), finished=True)
    assert final.stop_string is None and "".join(released) + final.text == "foo baz"


@settings(max_examples=150, deadline=None)
@given(
    words=st.lists(st.sampled_from(["ab", "ba", "a", "b", " ", "abc", "é", "😀", "c"]), min_size=1, max_size=20),
    stops=st.lists(st.sampled_from(["ab", "b a", "cé", "😀c", "a😀", "bab"]), min_size=1, max_size=3),
    include=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_streamed_text_never_leaks_a_stop_string(tokenizer, words, stops, include, seed):
    text = "".join(words)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    pieces, detok = stream(tokenizer, ids, params, random.Random(seed))
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if hits:
        end, start, stop = min(hits)
        expected = text[:end] if include else text[:start]
        assert detok.stop_string == stop
    else:
        expected = text
        assert detok.stop_string is None
    released = ""
    for piece in pieces:
        released += piece
        assert expected.startswith(released)  # nothing released is ever cut off later
    assert released == expected
