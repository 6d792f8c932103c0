"""The outputs of a forced `tool_choice`, which structured outputs constrain (see `frontend/tool_choice.py`): they are
read as that JSON, not through the configured tool parser, as vLLM reads them.

- a named function: the whole output is the function's arguments (`NamedToolCallParser`);
- "required": the output is a JSON list of `{"name": ..., "parameters": {...}}`, one object per call
  (`RequiredToolCallsParser`), each call's arguments the text of its "parameters".
"""

from __future__ import annotations

from tokenmill.frontend.tool_parsers.base import ToolParser
from tokenmill.frontend.tool_parsers.scan import WHITESPACE


class NamedToolCallParser(ToolParser):
    """One call of `function_name`; its first delta goes out with the first text."""

    name = "named"

    def __init__(self, function_name: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.function_name = function_name

    def fresh(self) -> NamedToolCallParser:
        return NamedToolCallParser(self.function_name, make_id=self.make_id)

    def _feed(self, text: str) -> None:
        if self.num_calls:
            self._arguments(text)
        else:
            self._start_call(self.function_name, text)

    def _end(self) -> None:
        pass


class RequiredToolCallsParser(ToolParser):
    name = "required"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._mode = "open"  # open | first_item | item | call | separator | closed

    def _feed(self, text: str) -> None:
        while text and not self._plain:
            if self._mode == "call":
                text = self._advance_call(text, "separator")
                if text is None:
                    return
                continue
            char = text[0]
            if char in WHITESPACE:
                self._hold(char)
                text = text[1:]
                continue
            if not self._punctuation(char):
                self._break(text)
                return
            text = text if self._mode == "call" else text[1:]

    def _punctuation(self, char: str) -> bool:
        """The list's brackets and commas; False for anything else where it stands."""
        mode = self._mode
        if mode == "open" and char == "[":
            self._mode = "first_item"
        elif mode in ("first_item", "item") and char == "{":
            self._mode = "call"
            self._new_call_object(args_keys=("parameters",))
            return True
        elif mode == "separator" and char in ",]":
            self._mode = "item" if char == "," else "closed"
        else:
            return False
        self._hold(char)
        return True

    def _end(self) -> None:
        if self._mode != "closed":
            self._break()
