"""Reasoning parsers: a reasoning model's thinking (`<think>...</think>`) split from its answer, as vLLM's
`--reasoning-parser`, whole or streamed.

Public API (used by /v1/chat/completions and /v1/responses):

    from tokenmill.frontend.reasoning_parsers import get_reasoning_parser, reasoning_parser_names

    parser = get_reasoning_parser("qwen3")(thinking=True)  # one object per response choice; KeyError for a bad name
    reasoning, content = parser.extract(text)              # a whole output (reasoning None: there was none)
    delta = parser.extract_streaming(piece)                # ReasoningDelta(reasoning, content), in order
    delta = parser.finish()                                # once the output has ended: what was held back

`thinking=False` says the prompt already ended the thinking (`chat_template_kwargs: {"enable_thinking": false}`, or
a generation prompt that closes it, `thinking_closed_by_prompt`): the whole output is content. Markers are matched in
the text, held back while they may be arriving, so any chunking gives the same split as `extract`.

- `deepseek_r1`: the output is reasoning until `</think>` (the template opens `<think>` in the prompt; an output
  that starts with `<think>` itself has it stripped); with no `</think>`, all of it is reasoning.
- `qwen3`: reasoning only when the output itself opens `<think>` (older Qwen3 templates): text before it and after
  `</think>` is content; with no `<think>`, all of it is content. An unclosed `<think>` leaves the rest reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tokenmill.frontend.tool_parsers.scan import held_prefix

START = "<think>"
END = "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    name: ClassVar[str] = ""
    start: ClassVar[str] = START
    end: ClassVar[str] = END
    first_mode: ClassVar[str] = "reasoning"

    def __init__(self, *, thinking: bool = True) -> None:
        self.thinking = thinking
        self._mode = self.first_mode if thinking else "content"  # opening | before | reasoning | content
        self._held = ""
        self.saw_reasoning = thinking and self.first_mode != "before"  # an output with reasoning, even empty
        self._out = ReasoningDelta()

    @property
    def reasoning_ended(self) -> bool:
        return self._mode == "content"

    def extract(self, text: str) -> tuple[str | None, str]:
        parser = type(self)(thinking=self.thinking)
        first, last = parser.extract_streaming(text), parser.finish()
        reasoning = first.reasoning + last.reasoning
        return (reasoning if parser.saw_reasoning else None), first.content + last.content

    def extract_streaming(self, delta_text: str) -> ReasoningDelta:
        self._out = ReasoningDelta()
        text = self._held + delta_text
        self._held = ""
        while text:
            text = self._step(text)
        return self._out

    def finish(self) -> ReasoningDelta:
        self._out = ReasoningDelta()
        held, self._held = self._held, ""
        if self._mode == "reasoning":
            self._out.reasoning += held
        else:
            self._out.content += held
        return self._out

    def _step(self, text: str) -> str:
        mode = self._mode
        if mode == "content":
            self._out.content += text
            return ""
        if mode == "opening":  # the output's very start: an opening marker there is dropped
            if text.startswith(self.start):
                self._mode = "reasoning"
                return text[len(self.start) :]
            if self.start.startswith(text):
                self._held = text
                return ""
            self._mode = "reasoning"
            return text
        marker = self.start if mode == "before" else self.end
        at = text.find(marker)
        if at < 0:
            keep = held_prefix(text, marker)
            self._emit(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            return ""
        self._emit(text[:at])
        self._mode = "reasoning" if mode == "before" else "content"
        self.saw_reasoning = self.saw_reasoning or self._mode == "reasoning"
        return text[at + len(marker) :]

    def _emit(self, text: str) -> None:
        if self._mode == "reasoning":
            self._out.reasoning += text
        else:
            self._out.content += text


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    first_mode = "opening"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    first_mode = "before"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser_names() -> list[str]:
    return sorted(REASONING_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; KeyError (naming the choices) for any other name."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise KeyError(
            f"unknown reasoning parser {name!r} (choose from {', '.join(reasoning_parser_names())})"
        ) from None


def end_marker_ids(parser: type[ReasoningParser], tokenizer: Any) -> list[int]:
    """The token ids of the end-of-thinking marker (a structured output's `begin_after_token_ids`)."""
    return list(tokenizer.encode(parser.end, add_special_tokens=False))


def thinking_closed_by_prompt(parser: type[ReasoningParser], tokenizer: Any, prompt_ids: list[int]) -> bool:
    """Whether the generation prompt already ends the thinking (Qwen3's template with enable_thinking false ends it
    with `<think>\\n\\n</think>\\n\\n`), as vLLM checks the prompt's token ids."""
    tail = tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False)
    return tail.rstrip().endswith(parser.end)
