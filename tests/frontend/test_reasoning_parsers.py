"""The reasoning parsers (tokenmill.frontend.reasoning_parsers): thinking split from the answer, whole and streamed in
any chunking, as vLLM's deepseek_r1 and qwen3 parsers split it."""

from __future__ import annotations

import random

import pytest

from tokenmill.frontend.reasoning_parsers import (
    end_marker_ids,
    get_reasoning_parser,
    reasoning_parser_names,
    thinking_closed_by_prompt,
)

CASES = {
    # output -> (reasoning, content)
    "deepseek_r1": [
        ("I should add.</think>The answer is 4.", ("I should add.", "The answer is 4.")),
        ("<think>\nStripped opening.\n</think>\n\nAnswer", ("\nStripped opening.\n", "\n\nAnswer")),
        ("Still thinking when cut off", ("Still thinking when cut off", "")),
        ("</think>", ("", "")),
        ("a < b, </thin k> is not </think>it: </think> stays", ("a < b, </thin k> is not ", "it: </think> stays")),
        ("", ("", "")),
    ],
    "qwen3": [
        ("<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
        ("No thinking here.", (None, "No thinking here.")),
        ("Before <think>inside</think>after", ("inside", "Before after")),
        ("<think>cut off mid-thought", ("cut off mid-thought", "")),
        ("<thin", (None, "<thin")),
        ("", (None, "")),
    ],
}


def pieces_of(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_and_streamed_splits_agree(name):
    cls = get_reasoning_parser(name)
    rng = random.Random(0)
    for text, expected in CASES[name]:
        assert cls().extract(text) == expected, text
        for pieces in [list(text), [text], *(pieces_of(text, rng) for _ in range(30))]:
            parser = cls()
            deltas = [parser.extract_streaming(p) for p in pieces] + [parser.finish()]
            reasoning = "".join(d.reasoning for d in deltas)
            content = "".join(d.content for d in deltas)
            assert (reasoning if expected[0] is not None else None, content) == expected, (text, pieces)


def test_thinking_off_makes_everything_content():
    for name in reasoning_parser_names():
        cls = get_reasoning_parser(name)
        for text in ("plain answer", "<think>x</think>y"):
            assert cls(thinking=False).extract(text) == (None, text)
            parser = cls(thinking=False)
            assert parser.extract_streaming(text).content == text and parser.reasoning_ended


def test_registry_and_markers(tokenizer):
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    with pytest.raises(KeyError) as info:
        get_reasoning_parser("granite")
    assert "deepseek_r1" in str(info.value) and "qwen3" in str(info.value)
    cls = get_reasoning_parser("qwen3")
    ids = end_marker_ids(cls, tokenizer)
    assert tokenizer.decode(ids) == "</think>"
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    open_ = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    history = tokenizer.encode("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert thinking_closed_by_prompt(cls, tokenizer, closed)
    assert not thinking_closed_by_prompt(cls, tokenizer, open_)
    assert not thinking_closed_by_prompt(cls, tokenizer, history)
