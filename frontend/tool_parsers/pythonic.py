"""`pythonic`: calls written as a Python list of function calls with keyword arguments,
`[get_weather(city="Paris", unit="c"), get_time(zone='CET')]` (Llama 3.2 and 4, ToolACE).

As vLLM's parser: the output must start with the list (whitespace before it is allowed here) and arguments must be
literals (strings, numbers, True/False/None, lists, dicts with string keys); a call's arguments become a JSON object.
Anything else is content. Text after the list is content (whitespace alone is dropped).
"""

from __future__ import annotations

import json

from tokenmill.frontend.tool_parsers.base import ToolParser
from tokenmill.frontend.tool_parsers.python_literals import LiteralToJson, is_identifier_char, is_identifier_start
from tokenmill.frontend.tool_parsers.scan import WHITESPACE


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # lead | call_name_first | call_name | name | keyword_or_close | keyword | equals | value | after_value |
        # after_call | trailing
        self._mode = "lead"
        self._name = ""
        self._keyword = ""
        self._num_args = 0
        self._value: LiteralToJson | None = None

    def _feed(self, text: str) -> None:
        i = 0
        while i < len(text) and not self._plain:
            if self._mode == "trailing":
                self._text(text[i:])
                return
            if self._mode == "value":
                i = self._feed_value(text, i)
                continue
            char = text[i]
            if not self._step(char):
                self._break(text[i:])
                return
            i += 1

    def _step(self, char: str) -> bool:
        """Take one character outside argument values; False when the output is not a call list."""
        mode = self._mode
        if mode == "name":
            if is_identifier_char(char):
                self._name += char
                return self._keep(char)
            if char != "(":
                return False
            self._hold(char)
            self._start_call(self._name, "{")
            self._mode, self._num_args = "keyword_or_close", 0
            return True
        if mode == "keyword":
            if is_identifier_char(char):
                self._keyword += char
                return self._keep(char)
            mode = self._mode = "equals"
        if char in WHITESPACE:
            return self._keep(char)
        if mode == "lead":
            return self._to("call_name_first", char) if char == "[" else False
        if mode in ("call_name_first", "call_name"):
            if char == "]" and mode == "call_name":  # a trailing comma
                self._mode = "trailing"
                return True
            if not is_identifier_start(char):
                return False
            self._name = char
            return self._to("name", char)
        if mode == "keyword_or_close":
            if char == ")":
                return self._close_call()
            if not is_identifier_start(char):
                return False
            self._keyword = char
            return self._to("keyword", char)
        if mode == "equals":
            if char != "=":
                return False
            self._arguments((", " if self._num_args else "") + json.dumps(self._keyword, ensure_ascii=False) + ": ")
            self._num_args += 1
            self._value = LiteralToJson()
            self._mode = "value"
            return True
        if mode == "after_value":
            if char == ",":
                return self._to("keyword_or_close", char)
            return self._close_call() if char == ")" else False
        if mode == "after_call":
            if char == ",":
                return self._to("call_name", char)
            if char == "]":
                self._mode = "trailing"
                return True
        return False

    def _keep(self, char: str) -> bool:
        self._hold(char)
        return True

    def _to(self, mode: str, char: str) -> bool:
        self._mode = mode
        return self._keep(char)

    def _close_call(self) -> bool:
        self._arguments("}")
        self._mode = "after_call"
        return True

    def _feed_value(self, text: str, at: int) -> int:
        value = self._value
        taken, json_text = value.feed(text, at)
        self._arguments(json_text)
        if value.error:
            self._break(text[taken:])
            return len(text)
        if value.done:
            self._mode = "after_value"
        return taken

    def _end(self) -> None:
        if self._mode == "trailing":
            self._ws = ""
        else:
            self._break()
