"""`hermes`: Hermes 2 Pro, Qwen2.5 and Qwen3 models, which write each call as
`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`.

As vLLM's parser: text before the first call is content; the last call may lack its closing tag; anything but
whitespace around a call's JSON inside the tags makes the output malformed. Whitespace between and after calls is
dropped; other text there is content.
"""

from __future__ import annotations

from tokenmill.frontend.tool_parsers.base import ToolParser
from tokenmill.frontend.tool_parsers.scan import WHITESPACE

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._mode = "text"  # text | call | close
        self._close = ""  # what followed a call's JSON so far

    def _feed(self, text: str) -> None:
        while text and not self._plain:
            if self._mode == "text":
                text = self._text_until(text, START)
                if text is None:
                    return
                self._mode, self._close = "call", ""
                self._new_call_object()
            elif self._mode == "call":
                text = self._advance_call(text, "close")
                if text is None:
                    return
            else:
                text = self._feed_close(text)

    def _feed_close(self, text: str) -> str:
        """After a call's JSON: whitespace, then the closing tag."""
        for i, char in enumerate(text):
            self._close += char
            stripped = self._close.lstrip(WHITESPACE)
            if stripped == END:
                self._mode, self._close = "text", ""
                return text[i + 1 :]
            if stripped and not END.startswith(stripped):
                self._break(self._close + text[i + 1 :])
                return ""
        return ""

    def _end(self) -> None:
        if self._mode == "call":
            self._break()
        elif self._mode == "close":
            if self._close.strip(WHITESPACE):  # the start of a closing tag
                self._break(self._close)
        else:
            self._end_text()
