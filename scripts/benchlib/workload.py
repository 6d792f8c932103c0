"""Synthetic benchmark workloads: random prompts with input and output lengths drawn uniformly from ranges.

Every benchmark builds its requests here from one seed, so the offline and the serving benchmark run the same
workload. Prompts are random token ids drawn from the tokenizer's ordinary (non-special) vocabulary; a text form is
made by decoding them, which re-tokenizes to roughly (not exactly) the same length.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthRange:
    """An inclusive integer range [low, high]; written "64:512", or "128" for a fixed length."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        low, _, high = text.partition(":")
        try:
            bounds = cls(int(low), int(high or low))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a length like 128 or a range like 64:512, got {text!r}"
            ) from None
        if bounds.low < 1 or bounds.high < bounds.low:
            raise argparse.ArgumentTypeError(f"expected 1 <= low <= high, got {text!r}")
        return bounds

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    prompt_text: str | None = None  # set when the workload was built with text prompts

    @property
    def input_len(self) -> int:
        return len(self.prompt_ids)


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """Every token id of the vocabulary that is not a special or added token."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def build_workload(
    tokenizer, num_prompts: int, input_len: LengthRange, output_len: LengthRange, seed: int = 0, with_text: bool = False
) -> list[BenchRequest]:
    """`num_prompts` random requests; with `with_text` each also carries a decoded prompt (re-tokenized for its ids)."""
    rng = np.random.default_rng(seed)
    vocab = ordinary_token_ids(tokenizer)
    input_lens = input_len.sample(rng, num_prompts)
    output_lens = output_len.sample(rng, num_prompts)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = [int(t) for t in rng.choice(vocab, size=n_in)]
        text = None
        if with_text:
            # decoding random ids and encoding again merges some tokens: keep the re-encoded ids, cut to length
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)[:n_in]
            text = tokenizer.decode(ids)
        requests.append(BenchRequest(ids, n_out, text))
    return requests


def load_tokenizer(name_or_path: str):
    """An HF tokenizer from a directory, a .gguf file, a hub id, or "" for tokenmill's default model."""
    import os

    from transformers import AutoTokenizer

    if not name_or_path or name_or_path.endswith(".gguf") or os.path.isdir(name_or_path):
        from tokenmill.model_source import locate_model

        path, gguf_file, _ = locate_model(name_or_path)
        if gguf_file is not None:
            return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(name_or_path)
