"""Text pairs for a sequence classifier: which pairs a /score or /rerank call makes, and their token ids.

Pairs follow vLLM's `_validate_score_input_lens`: one text_1 against N text_2 (1:N, also 1:1), or N against N
element-wise. A pair is tokenized as the tokenizer's `text_pair` (`[CLS] a [SEP] b [SEP]` for BERT, `<s> a </s></s> b
</s>` for RoBERTa), exactly as sentence-transformers' CrossEncoder does; BERT's token_type_ids (0 for the first
text, 1 from the second on) travel as the index where the second segment starts. Shared by the server
(`frontend/serving_score.py`) and the offline `LLM.score`.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class PairingError(ValueError):
    """Texts that do not pair; `param` names the field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class EncodedPair(NamedTuple):
    token_ids: list[int]
    second_segment_start: int | None  # where token_type_id 1 starts; None: all 0 (RoBERTa, decoders)


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, in output order; PairingError naming the field when they do not pair."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts:
        raise PairingError("text_1", "must not be empty")
    if not seconds:
        raise PairingError("text_2", "must not be empty")
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise PairingError(
            "text_1",
            f"holds {len(firsts)} texts and text_2 {len(seconds)}; score one text_1 against any number "
            "of text_2, or N against N",
        )
    return list(zip(firsts, seconds, strict=True))


def encode_pairs(tokenizer: Any, pairs: list[tuple[str, str]], max_length: int | None) -> list[EncodedPair]:
    """Each pair's ids in one batch call (on the tokenizer thread); `max_length` truncates the longer text first,
    as CrossEncoder (None: no truncation)."""
    if not pairs:
        return []
    encoded = tokenizer(
        [first for first, _ in pairs],
        text_pair=[second for _, second in pairs],
        truncation="longest_first" if max_length is not None else False,
        max_length=max_length,
        return_token_type_ids=True,
    )
    token_types = encoded.get("token_type_ids") or [None] * len(pairs)
    return [
        EncodedPair(list(ids), _second_segment_start(types)) for ids, types in zip(encoded["input_ids"], token_types)
    ]


def encode_single_texts(tokenizer: Any, texts: list[str], max_length: int | None) -> list[EncodedPair]:
    """/classify inputs: one text each, no second segment."""
    if not texts:
        return []
    encoded = tokenizer(texts, truncation=max_length is not None, max_length=max_length)
    return [EncodedPair(list(ids), None) for ids in encoded["input_ids"]]


def _second_segment_start(token_types: list[int] | None) -> int | None:
    if not token_types or 1 not in token_types:
        return None
    start = token_types.index(1)
    if any(t != 1 for t in token_types[start:]):  # never seen: segments are one run of 0s then one of 1s
        raise ValueError("the tokenizer's token_type_ids are not one run of 0s followed by one run of 1s")
    return start
