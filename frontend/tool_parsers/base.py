"""What every tool parser shares: the shapes of its results and the streaming machinery behind them.

A parser object reads one choice's output text. `extract_streaming(delta_text)` takes the next piece of text and
returns a `StreamDelta` (content to send, tool-call deltas); `finish()` flushes what it held back once the output has
ended. `extract(text)` reads a whole output (it leaves the object's streaming state alone).

Subclasses implement `_feed(text)` and `_end()`, reporting through `_content`, `_start_call`, `_arguments` and
`_break`. They decide only from the text seen so far, so the deltas of any chunking of an output reassemble into the
same calls and content, and `extract` is exactly that reassembly, with one exception taken from vLLM's parsers: when
a call turns out malformed after part of it was streamed (`failed`), `extract` returns the whole output as content
and no calls. A malformed call noticed before any call was streamed is released as content in both modes.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from tokenmill.frontend.tool_parsers.scan import WHITESPACE, CallObjectScanner, held_prefix


def random_tool_call_id() -> str:
    """vLLM's tool-call id: "chatcmpl-tool-" and 32 random hex digits."""
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


@dataclass
class ToolCall:
    """One whole call: `arguments` is a JSON text (the model's own, for the JSON formats)."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """A piece of call `index`: its first piece carries `id` and `name`, every piece a fragment of the arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ExtractedToolCalls:
    """A whole output: `content` is the text outside the calls (None when there are calls and no text)."""

    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


def fold(deltas: list[StreamDelta]) -> ExtractedToolCalls:
    """Reassemble streamed deltas, as a client does."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            call = calls.get(piece.index)
            if call is None:
                calls[piece.index] = ToolCall(piece.id or "", piece.name or "", piece.arguments)
            else:
                call.arguments += piece.arguments
    tool_calls = [calls[i] for i in sorted(calls)]
    return ExtractedToolCalls(content if content or not tool_calls else None, tool_calls)


class ToolParser:
    """The base of every parser (see the module docstring). `keeps_special_tokens`: the format's markers are special
    tokens, so the output must be detokenized with them (vLLM's mistral parser does the same)."""

    name: ClassVar[str] = ""
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, make_id: Callable[[], str] = random_tool_call_id) -> None:
        self.make_id = make_id
        self.num_calls = 0
        self.failed = False  # a call already (partly) streamed turned out malformed
        self._plain = False  # given up on calls: everything from here on is content
        self._unreleased = ""  # text read into the first call before it was streamed
        self._scanner: CallObjectScanner | None = None
        self._committed = False  # the current call object's first delta went out
        self._sent = 0  # its arguments' characters sent
        self._pending = ""  # text outside calls held back: the start of a marker
        self._ws = ""  # whitespace after a call, held until other text follows (dropped otherwise)
        self._out = StreamDelta()

    def fresh(self) -> ToolParser:
        """A parser in its initial state, for another output."""
        return type(self)(make_id=self.make_id)

    # ------------------------------------------------------------------ public

    def extract_streaming(self, delta_text: str) -> StreamDelta:
        self._out = StreamDelta()
        if self._plain:
            self._content(delta_text)
        elif delta_text:
            self._feed(delta_text)
        return self._out

    def finish(self) -> StreamDelta:
        self._out = StreamDelta()
        if not self._plain:
            self._end()
        return self._out

    def extract(self, text: str) -> ExtractedToolCalls:
        parser = self.fresh()
        result = fold([parser.extract_streaming(text), parser.finish()])
        if parser.failed:
            return ExtractedToolCalls(text, [])
        return result

    # ------------------------------------------------------------------ for subclasses

    def _feed(self, text: str) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        self._out.content += text

    def _start_call(self, name: str, arguments: str = "") -> None:
        self._out.tool_calls.append(ToolCallDelta(self.num_calls, arguments, id=self.make_id(), name=name))
        self.num_calls += 1
        self._unreleased = ""

    def _arguments(self, text: str) -> None:
        if not text:
            return
        index = self.num_calls - 1
        calls = self._out.tool_calls
        if calls and calls[-1].index == index:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallDelta(index, text))

    def _hold(self, text: str) -> None:
        """Text read into the first call, not streamed yet (released as content if that call breaks)."""
        if not self.num_calls:
            self._unreleased += text

    def _break(self, rest: str = "") -> None:
        """The output is not (or no longer) in the format: what was held and `rest` are content, and so is
        everything after. A break after a call was streamed fails the whole output (`extract` gives it as text)."""
        if self.num_calls:
            self.failed = True
        self._content(self._unreleased + rest)
        self._unreleased = ""
        self._scanner = None
        self._plain = True

    # ------------------------------------------------------------------ text outside calls

    def _text_until(self, text: str, marker: str) -> str | None:
        """Text outside calls, up to `marker`: what follows the marker, or None when `text` holds none (the start of
        one is held back)."""
        buffer, self._pending = self._pending + text, ""
        at = buffer.find(marker)
        if at < 0:
            keep = held_prefix(buffer, marker)
            self._text(buffer[: len(buffer) - keep])
            self._pending = buffer[len(buffer) - keep :]
            return None
        self._text(buffer[:at])
        self._ws = ""
        self._hold(marker)
        return buffer[at + len(marker) :]

    def _text(self, text: str) -> None:
        """Text outside calls is content: all of it before the first call; after one, whitespace waits for other
        text and is dropped if none follows (between calls, and at the end)."""
        if not self.num_calls:
            self._content(text)
            return
        text = self._ws + text
        body = text.rstrip(WHITESPACE)
        self._content(body)
        self._ws = text[len(body) :]

    def _end_text(self) -> None:
        """The output ended outside a call: release what was held back."""
        rest, self._pending = self._pending, ""
        self._text(rest)
        self._ws = ""

    # ------------------------------------------------------------------ JSON call objects

    def _new_call_object(self, name_key: str = "name", args_keys: tuple[str, ...] = ("arguments",)) -> None:
        self._scanner = CallObjectScanner(name_key, args_keys)
        self._committed = False
        self._sent = 0

    def _feed_call_object(self, text: str) -> tuple[int, str]:
        """Feed the current call object: (characters it took, "more" | "done" | "broken"). Its first delta goes out
        once the name is complete and the arguments have begun; then the arguments as they arrive."""
        scanner = self._scanner
        taken = scanner.feed(text)
        self._hold(text[:taken])
        if not self._committed and scanner.name is not None and scanner.args_started:
            self._start_call(scanner.name, scanner.args_raw)
            self._committed = True
            self._sent = len(scanner.args_raw)
        elif self._committed:
            self._arguments(scanner.args_raw[self._sent :])
            self._sent = len(scanner.args_raw)
        if scanner.error:
            return taken, "broken"
        if scanner.done:
            if not (self._committed and scanner.validate()):
                return taken, "broken"
            self._scanner = None
            self._committed = False
            return taken, "done"
        return taken, "more"

    def _advance_call(self, text: str, mode_after: str) -> str | None:
        """Feed the current call object and switch to `mode_after` once it is complete. Returns the text after what
        it took, or None when the call broke (what is left has then become content)."""
        taken, status = self._feed_call_object(text)
        if status == "broken":
            self._break(text[taken:])
            return None
        if status == "done":
            self._mode = mode_after
        return text[taken:]
