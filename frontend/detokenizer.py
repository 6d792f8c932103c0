"""Incremental detokenization of one request's output, with stop strings and streaming hold-back.

Text is decoded with vLLM's prefix/read offsets: each step decodes a short window `ids[prefix_offset:]` and emits
what it adds beyond `ids[prefix_offset:read_offset]`. The window starts a few tokens back so tokenizers whose decoding
of a token depends on its neighbours (leading-space rules) render it as in a full decode, and nothing is emitted while
the window ends in U+FFFD: a multi-byte character split across tokens is released only once it is whole.

Stop strings are searched in the new text plus the tail that could start one across a token boundary; the text is cut
at the match (after it with `include_stop_str_in_output`). While a request runs, the last `len(longest stop) - 1`
characters are held back so a partial stop string never reaches a streaming client. As vLLM, stop strings are not
looked for until the output has more than `min_tokens` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from tokenmill.messages import SamplingParams

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, as vLLM does
REPLACEMENT_CHAR = "\ufffd"


class DetokenizerUpdate(NamedTuple):
    text: str  # text released by this update (all of the rest once finished or stopped)
    stop_string: str | None  # the stop string found in this update; the request must end (and be aborted)


def eos_token_ids_of(tokenizer: Any) -> frozenset[int]:
    ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return frozenset()
    return frozenset(ids) if isinstance(ids, (list, tuple, set, frozenset)) else frozenset([ids])


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a step at a time. Build one per choice."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.include_stop_str = params.include_stop_str_in_output
        self.stop = [s for s in params.stop if s]
        self.min_tokens = params.min_tokens
        self.num_output_tokens = 0
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.eos_token_ids = eos_token_ids_of(tokenizer)
        self.token_ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])  # decoding context, then outputs
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids)
        self.output_text = ""
        self.num_released = 0  # characters of output_text already handed out
        self.stop_string: str | None = None
        self.finished = False

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return  # nothing visible yet, or a character still incomplete: wait for more tokens
        self.output_text += new_text[len(self._prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])

    def _flush(self) -> None:
        """At the end, release what the window still holds back, even a trailing U+FFFD (a full decode has it too)."""
        if self.read_offset < len(self.token_ids):
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            if len(new_text) > len(self._prefix_text):
                self.output_text += new_text[len(self._prefix_text) :]
            self.prefix_offset = self.read_offset = len(self.token_ids)
            self._prefix_text = ""

    def _find_stop(self, num_new_chars: int) -> str | None:
        """Cut output_text at the first stop string completed by the new characters (the earliest to end; the
        longest on a tie); return it."""
        if not self.stop or num_new_chars <= 0:
            return None
        first_new = len(self.output_text) - num_new_chars
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, max(0, first_new - len(stop) + 1))
            if index != -1 and (best is None or (index + len(stop), index) < best[:2]):
                best = (index + len(stop), index, stop)
        if best is None:
            return None
        end, index, stop = best
        self.output_text = self.output_text[: end if self.include_stop_str else index]
        return stop

    def update(
        self, new_token_ids: Sequence[int], finished: bool = False, stop_token_id: int | None = None
    ) -> DetokenizerUpdate:
        """Add one step's tokens. `stop_token_id` (the EOS / stop id that ended the request, the last new id) is
        not rendered unless `include_stop_str_in_output`. Returns the text now safe to release."""
        if self.finished:
            return DetokenizerUpdate("", None)
        token_ids = list(new_token_ids)
        self.num_output_tokens += len(token_ids)
        if stop_token_id is not None and not self.include_stop_str and token_ids and token_ids[-1] == stop_token_id:
            token_ids.pop()
        length_before = len(self.output_text)
        for token_id in token_ids:
            self._append_token(token_id)
        if finished:
            self._flush()
        if self.num_output_tokens > self.min_tokens:
            self.stop_string = self._find_stop(len(self.output_text) - length_before)
        self.finished = finished or self.stop_string is not None
        return DetokenizerUpdate(self._release(), self.stop_string)

    def _release(self) -> str:
        end = len(self.output_text) if self.finished else max(self.num_released, len(self.output_text) - self.hold_back)
        text = self.output_text[self.num_released : end]
        self.num_released = end
        return text
