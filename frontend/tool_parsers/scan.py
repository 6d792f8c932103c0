"""Incremental scanners the tool parsers share: where a marker may begin in streamed text, where one JSON value
ends, and the parts of a tool call written as one JSON object (`{"name": ..., "arguments": {...}}`).

They are fed text in pieces of any size and decide only from what they have seen, so a parser built on them gives the
same result however its input is cut. They track structure (strings, escapes, nesting, keys) but do not validate
scalars; a whole call object is checked with `json.loads` once it is complete (`CallObjectScanner.validate`).
"""

from __future__ import annotations

import json
from typing import Any

WHITESPACE = " \t\r\n"


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `marker` (text to hold back: the marker
    may be arriving)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class JsonValueScanner:
    """Finds where one JSON value ends. `feed(text)` returns how many characters of `text` belong to the value;
    fewer than all once the value has ended (`done`) or the text breaks JSON's structure (`error`). A number or
    literal ends at the first character that cannot continue it, which is not consumed."""

    SCALAR = frozenset("0123456789+-.eEtrufalsn")

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers: "{" or "["
        self.in_string = False
        self.escaped = False
        self.scalar = False  # a bare number or literal at the top
        self.started = False
        self.done = False
        self.error = False

    def feed(self, text: str) -> int:
        for i, char in enumerate(text):
            if self.done or self.error:
                return i
            if not self._step(char):
                return i
        return len(text)

    def _step(self, char: str) -> bool:
        """Take one character; False when it is not part of the value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if not self.stack:
                    self.done = True
            return True
        if not self.started:
            self.started = True
            if char in "{[":
                self.stack.append(char)
            elif char == '"':
                self.in_string = True
            elif char in self.SCALAR:
                self.scalar = True
            else:
                self.error = True
                return False
            return True
        if self.scalar:
            if char in self.SCALAR:
                return True
            self.done = True
            return False
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.stack.append(char)
        elif char in "}]":
            if self.stack.pop() != ("{" if char == "}" else "["):
                self.error = True
                return False
            if not self.stack:
                self.done = True
        return True

    def end(self) -> None:
        """The text has ended: a bare scalar ends with it."""
        if self.scalar and not self.error:
            self.done = True


class CallObjectScanner:
    """One tool call written as a JSON object with a string `name_key` and an arguments value under one of
    `args_keys`, in either order, among any other keys. `feed(text)` returns how many characters belong to the
    object. As they arrive: `name` (once its string is complete), `args_raw` (the arguments' exact text so far),
    `args_started`, `done` (the closing brace was read), `error` (not such an object)."""

    def __init__(self, name_key: str = "name", args_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.name_key = name_key
        self.args_keys = args_keys
        self.raw: list[str] = []
        self.state = "open"
        self.key_raw = ""
        self.key: str | None = None
        self.keys: set[str] = set()
        self.value: JsonValueScanner | None = None
        self.name_raw = ""
        self.name: str | None = None
        self.args_raw = ""
        self.args_key: str | None = None
        self.done = False
        self.error = False

    @property
    def args_started(self) -> bool:
        return self.args_key is not None and self.args_raw != ""

    def feed(self, text: str) -> int:
        consumed = 0
        while consumed < len(text) and not (self.done or self.error):
            taken = self._take(text, consumed)
            if taken == 0:
                self.error = True
                break
            self.raw.append(text[consumed : consumed + taken])
            consumed += taken
        return consumed

    def _take(self, text: str, at: int) -> int:
        """Consume from text[at:] in the current state: how many characters (0: an error at text[at])."""
        char = text[at]
        state = self.state
        if state in ("value", "name"):
            return self._take_value(text, at)
        if char in WHITESPACE and state != "key":
            return 1
        if state == "open":
            return self._to("first_key") if char == "{" else 0
        if state in ("first_key", "next_key"):
            if char == '"':
                self.key_raw = '"'
                return self._to("key")
            if char == "}" and state == "first_key":
                return self._finish()
            return 0
        if state == "key":
            end = _string_end(text, at, self.key_raw)
            self.key_raw += text[at : end if end >= 0 else len(text)]
            if end < 0:
                return len(text) - at
            return end - at if self._key_done() else 0
        if state == "colon":
            return self._to("value_start") if char == ":" else 0
        if state == "value_start":
            return self._start_value(char)
        if state == "after_value":
            if char == ",":
                return self._to("next_key")
            return self._finish() if char == "}" else 0
        return 0

    def _to(self, state: str) -> int:
        self.state = state
        return 1

    def _finish(self) -> int:
        self.done = True
        return 1

    def _key_done(self) -> bool:
        try:
            key = json.loads(self.key_raw)
        except ValueError:
            return False
        if key in self.keys:
            return False  # a key given twice
        if key in self.args_keys and self.args_key is not None:
            return False  # "arguments" and "parameters" both
        self.keys.add(key)
        self.key = key
        self.state = "colon"
        return True

    def _start_value(self, char: str) -> int:
        if self.key == self.name_key:
            if char != '"':
                return 0
            self.name_raw = '"'
            return self._to("name")
        self.value = JsonValueScanner()
        if self.key in self.args_keys:
            self.args_key = self.key
        self.state = "value"
        return self._take_value(char, 0)

    def _take_value(self, text: str, at: int) -> int:
        if self.state == "name":
            end = _string_end(text, at, self.name_raw)
            self.name_raw += text[at : end if end >= 0 else len(text)]
            if end < 0:
                return len(text) - at
            try:
                self.name = json.loads(self.name_raw)
            except ValueError:
                return 0
            self.state = "after_value"
            return end - at
        value = self.value
        taken = value.feed(text[at:])
        if self.key == self.args_key:
            self.args_raw += text[at : at + taken]
        if value.error:
            return 0
        if value.done:
            self.state = "after_value"
            if taken == 0:  # a bare number ended at this character: read it as what follows the value
                return self._take(text, at)
        return taken

    def validate(self) -> bool:
        """The complete object parses as JSON, with a string name and the arguments."""
        if not self.done or self.name is None or self.args_key is None:
            return False
        try:
            parsed: Any = json.loads("".join(self.raw))
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the interpreter's stack
            return False
        return isinstance(parsed, dict) and parsed.get(self.name_key) == self.name


def _string_end(text: str, at: int, so_far: str) -> int:
    """Where the JSON string whose text so far is `so_far` (from its opening quote) closes in text[at:]: the index
    just past the closing quote, or -1 if it does not close there."""
    escaped = _ends_in_escape(so_far)
    for i in range(at, len(text)):
        char = text[i]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return i + 1
    return -1


def _ends_in_escape(so_far: str) -> bool:
    """Whether the string so far ends inside an escape (an odd run of backslashes after its opening quote)."""
    run = len(so_far) - len(so_far.rstrip("\\"))
    return run % 2 == 1
