"""A Python literal, streamed character by character, written out as JSON as soon as each part is certain: the
pythonic tool parser's arguments.

Strings (single or double quotes, with escapes), numbers, True/False/None, lists and dicts with string keys are
literals; a string or number is converted (`ast.literal_eval`, then `json.dumps`) once it is complete. Anything else,
or a number JSON cannot hold (inf, nan, complex), is an error.
"""

from __future__ import annotations

import ast
import json
import math
import string

ATOM_CHARS = frozenset(string.ascii_letters + string.digits + "_.+-")
IDENTIFIER_START = frozenset(string.ascii_letters + "_")
IDENTIFIER_CHARS = frozenset(string.ascii_letters + string.digits + "_")
WHITESPACE = " \t\r\n"
NAMES = {"True": "true", "False": "false", "None": "null"}


def is_identifier_start(char: str) -> bool:
    return char in IDENTIFIER_START


def is_identifier_char(char: str) -> bool:
    return char in IDENTIFIER_CHARS


class LiteralToJson:
    """`feed(text, at)` reads from text[at:] and returns (where it stopped, the JSON text now certain). It stops at
    the end of the text, after the literal (`done`; a number ends at the character after it, which it leaves), or
    at a character that breaks it (`error`)."""

    def __init__(self) -> None:
        self.stack: list[list] = []  # open containers: [kind ("list" | "dict"), items so far]
        self.state = "value"  # value | item_or_close | key_or_close | colon | after
        self.kind: str | None = None  # the scalar being read: "str" | "atom" | None
        self.token = ""
        self.quote = ""
        self.escaped = False
        self.is_key = False
        self.done = False
        self.error = False

    def feed(self, text: str, at: int) -> tuple[int, str]:
        out: list[str] = []
        i = at
        while i < len(text) and not (self.done or self.error):
            if self._step(text[i], out):
                i += 1
        return i, "".join(out)

    def _step(self, char: str, out: list[str]) -> bool:
        """Take one character: False when it was not consumed (it ended a number, or it is an error)."""
        if self.kind == "str":
            self.token += char
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == "\n":
                self.error = True
                return False
            elif char == self.quote:
                self._scalar_done(out)
            return True
        if self.kind == "atom":
            if char in ATOM_CHARS:
                self.token += char
                return True
            self._scalar_done(out)
            return False
        if char in WHITESPACE:
            return True
        state = self.state
        if state == "after":
            return self._after_value(char, out)
        if state == "colon":
            if char != ":":
                self.error = True
                return False
            self.state = "value"
            return True
        if state == "key_or_close":
            if char == "}":
                return self._close(out)
            if char not in "'\"":
                self.error = True
                return False
            self.is_key = True
            return self._begin_string(char)
        if state == "item_or_close" and char == "]":
            return self._close(out)
        return self._begin_value(char, out)

    def _begin_value(self, char: str, out: list[str]) -> bool:
        if self.stack and self.stack[-1][0] == "list" and self.stack[-1][1]:
            out.append(", ")
        if char in "'\"":
            return self._begin_string(char)
        if char == "[":
            self.stack.append(["list", 0])
            self.state = "item_or_close"
            out.append("[")
            return True
        if char == "{":
            self.stack.append(["dict", 0])
            self.state = "key_or_close"
            out.append("{")
            return True
        if char in ATOM_CHARS:
            self.kind, self.token = "atom", char
            return True
        self.error = True
        return False

    def _begin_string(self, quote: str) -> bool:
        self.kind, self.token, self.quote, self.escaped = "str", quote, quote, False
        return True

    def _scalar_done(self, out: list[str]) -> None:
        kind, token = self.kind, self.token
        self.kind, self.token = None, ""
        if kind == "atom" and token in NAMES:
            return self._value_done(NAMES[token], out)
        try:
            value = ast.literal_eval(token)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            self.error = True
            return
        if kind == "str":
            if not isinstance(value, str):
                self.error = True
                return
            if self.is_key:
                self.is_key = False
                items = self.stack[-1][1]
                out.append((", " if items else "") + json.dumps(value, ensure_ascii=False) + ": ")
                self.state = "colon"
                return
            return self._value_done(json.dumps(value, ensure_ascii=False), out)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))
        ):
            self.error = True
            return
        self._value_done(json.dumps(value), out)

    def _value_done(self, json_text: str, out: list[str]) -> None:
        out.append(json_text)
        if not self.stack:
            self.done = True
            return
        self.stack[-1][1] += 1
        self.state = "after"

    def _after_value(self, char: str, out: list[str]) -> bool:
        kind = self.stack[-1][0]
        if char == ",":
            self.state = "item_or_close" if kind == "list" else "key_or_close"
            return True
        if char == ("]" if kind == "list" else "}"):
            return self._close(out)
        self.error = True
        return False

    def _close(self, out: list[str]) -> bool:
        kind, _ = self.stack.pop()
        self._value_done("]" if kind == "list" else "}", out)
        return True
