"""`mistral`: Mistral models' `[TOOL_CALLS]` marker, followed either by a JSON list of calls (Mistral 7B v0.3, older
tokenizers: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`) or by calls written as a name and its JSON
arguments (tokenizer v11 and later: `[TOOL_CALLS]f{...}`, `[TOOL_CALLS]f[ARGS]{...}`, several separated by commas or
by another marker).

As vLLM's parser: text before the marker is content; tool-call ids are 9 alphanumeric characters (what Mistral's chat
templates accept back); the marker is a special token, so the output is detokenized with special tokens.
"""

from __future__ import annotations

import json
import secrets
import string

from tokenmill.frontend.tool_parsers.base import ToolParser
from tokenmill.frontend.tool_parsers.scan import WHITESPACE, JsonValueScanner

MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"
NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_tool_call_id() -> str:
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def __init__(self, make_id=mistral_tool_call_id) -> None:
        super().__init__(make_id=make_id)
        # text | after_marker | list_item | list_next | list_sep | call | name | args_marker | args_start | args |
        # after_args
        self._mode = "text"
        self._name = ""
        self._args_marker = ""
        self._args: JsonValueScanner | None = None
        self._args_raw = ""

    def _feed(self, text: str) -> None:
        while text and not self._plain:
            mode = self._mode
            if mode == "text":
                text = self._text_until(text, MARKER)
                if text is None:
                    return
                self._mode = "after_marker"
            elif mode == "call":
                text = self._advance_call(text, "list_sep")
                if text is None:
                    return
            elif mode == "name":
                text = self._feed_name(text)
            elif mode == "args_marker":
                text = self._feed_args_marker(text)
            elif mode == "args_start":
                text = self._begin_args(text)
            elif mode == "args":
                text = self._feed_args(text)
            else:
                text = self._feed_punctuation(text)

    def _feed_punctuation(self, text: str) -> str:
        """One character between the parts of the calls: whitespace, or what leads to the next part."""
        char = text[0]
        if char in WHITESPACE:
            self._hold(char)
            if self._mode == "after_args":
                self._ws += char
            return text[1:]
        step = self._next_mode(char)
        if step is None:
            self._break(text)
            return ""
        self._mode, consumed = step
        if self._mode == "name":
            self._name = ""
        elif self._mode == "call":
            self._new_call_object()
        if not consumed:
            return text
        self._hold(char)
        return text[1:]

    def _next_mode(self, char: str) -> tuple[str, bool] | None:
        """(the next mode, whether it takes `char`) after `char` in the current mode; None: not the format."""
        mode = self._mode
        if mode == "after_marker":
            if char == "[":
                return "list_item", True
            if char in NAME_CHARS:
                return "name", False
        elif mode in ("list_item", "list_next"):
            if char == "{":
                return "call", False
        elif mode == "list_sep":
            if char == ",":
                return "list_next", True
            if char == "]":
                return "text", True
        elif mode == "after_args":
            if char == ",":
                self._ws = ""
                return "after_marker", True
            return "text", False  # other text, or the next marker
        return None

    def _feed_name(self, text: str) -> str:
        for i, char in enumerate(text):
            if char in NAME_CHARS:
                self._name += char
                self._hold(char)
            elif char == "{":
                return self._begin_args(text[i:])
            elif char == "[":
                self._mode, self._args_marker = "args_marker", ""
                return text[i:]
            else:
                self._break(text[i:])
                return ""
        return ""

    def _feed_args_marker(self, text: str) -> str:
        for i, char in enumerate(text):
            self._args_marker += char
            self._hold(char)
            if self._args_marker == ARGS_MARKER:
                self._mode = "args_start"
                return text[i + 1 :]
            if not ARGS_MARKER.startswith(self._args_marker):
                self._break(text[i + 1 :])
                return ""
        return ""

    def _begin_args(self, text: str) -> str:
        """The arguments' JSON object starts the text; the call's first delta goes out with it."""
        if text[0] != "{":
            self._break(text)
            return ""
        self._start_call(self._name)
        self._args, self._args_raw = JsonValueScanner(), ""
        self._mode = "args"
        return text

    def _feed_args(self, text: str) -> str:
        scanner = self._args
        taken = scanner.feed(text)
        self._args_raw += text[:taken]
        self._arguments(text[:taken])
        if not scanner.error and scanner.done:
            try:
                json.loads(self._args_raw)
            except (ValueError, RecursionError):
                scanner.error = True
        if scanner.error:
            self._break(text[taken:])
            return ""
        if scanner.done:
            self._mode, self._ws = "after_args", ""
        return text[taken:]

    def _end(self) -> None:
        if self._mode == "text":
            self._end_text()
        elif self._mode == "after_args":
            self._ws = ""
        else:
            self._break()
