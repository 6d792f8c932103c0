"""n-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of a request's suffix.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the request's last n tokens are looked for among its
earlier tokens (prompt and output); the latest occurrence that has a token after it wins, and up to k of the tokens
that followed it are proposed. Copy-heavy generations (rewriting code, quoting the prompt) repeat long runs of the
prompt, so the drafts are often right; elsewhere nothing matches and nothing is proposed.

The search is numpy over a per-request token buffer that grows with the request (`TokenBuffer`): one vectorised
compare of the whole history against the suffix's first token, then the few candidates are narrowed token by token.
A few microseconds for a few thousand tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenBuffer:
    """A request's tokens as a numpy array, extended in place as the request grows (its tokens never change)."""

    __slots__ = ("_array", "size")

    def __init__(self) -> None:
        self._array = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append the tokens past what the buffer holds; returns a view of all of them."""
        count = len(token_ids)
        if count > self.size:
            if count > len(self._array):
                grown = np.empty(max(count, 2 * len(self._array)), dtype=np.int64)
                grown[: self.size] = self._array[: self.size]
                self._array = grown
            self._array[self.size : count] = token_ids[self.size : count]
            self.size = count
        return self._array[: self.size]


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, tokens: np.ndarray, max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the latest earlier match of the longest matching suffix."""
        num_tokens = len(tokens)
        if max_drafts <= 0:
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n :]
            # a match starting at i covers [i, i + n) and must leave a token after it that is not the suffix's own
            candidates = np.flatnonzero(tokens[: num_tokens - n] == suffix[0])
            for j in range(1, n):
                if candidates.size == 0:
                    break
                candidates = candidates[tokens[candidates + j] == suffix[j]]
            if candidates.size:
                start = int(candidates[-1]) + n
                drafts: list[int] = tokens[start : start + max_drafts].tolist()
                return drafts
        return []
