"""A choice's output, assembled once for the server and for the offline `LLM`.

A request's n choices run as `choice_requests` (tokenmill/messages.py) say. Each engine step's `RequestOutput` for a
choice is folded by `next_delta` into a `ChoiceDelta`: the text its detokenizer releases, and, on the choice's last
step, why it finished. That is the one place finish and stop reasons are decided: a stop string ends the choice with
finish_reason "stop" and the string as stop_reason; otherwise the engine's reason stands, with the stop token id as
stop_reason (None for EOS, as vLLM). `CompletionOutput` (vLLM's name) folds a choice's deltas into the whole choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.messages import PromptLogprobs, RequestOutput

TokenLogprobs = tuple[float, list[int], list[float]]  # (logprob of the token, top ids, top logprobs)


@dataclass
class ChoiceDelta:
    """What one engine step added to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with the choice's first delta, when asked for


def next_delta(index: int, detokenizer: IncrementalDetokenizer, out: RequestOutput) -> ChoiceDelta:
    """Fold one engine step's output for choice `index` into its delta; the delta with a finish_reason is the last."""
    engine_done = out.finish_reason is not None
    update = detokenizer.update(out.new_token_ids, engine_done, out.stop_token_id)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    if update.stop_string is not None:
        finish_reason, stop_reason = "stop", update.stop_string
    elif engine_done:
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
    return ChoiceDelta(
        index, update.text, list(out.new_token_ids), out.logprobs, finish_reason, stop_reason, out.prompt_logprobs
    )


@dataclass
class CompletionOutput:
    """A whole choice, folded from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # None unless the engine returned logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # engine entries, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
