"""`llama3_json`: Llama 3.1-3.3 (and 4) JSON tool calls: the output starts (after whitespace, and an optional
`<|python_tag|>`) with `{"name": "f", "parameters": {...}}` ("arguments" is accepted too), several calls separated
by `;`.

As vLLM's streaming parser: an output that does not start so is plain content. Text after the calls is content
(whitespace alone is dropped).
"""

from __future__ import annotations

from tokenmill.frontend.tool_parsers.base import ToolParser
from tokenmill.frontend.tool_parsers.scan import WHITESPACE

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._mode = "lead"  # lead | call | between | trailing
        self._lead = ""  # what was read before a call's `{`: whitespace, the python tag

    def _feed(self, text: str) -> None:
        while text and not self._plain:
            if self._mode == "lead":
                text = self._feed_lead(text)
            elif self._mode == "call":
                text = self._advance_call(text, "between")
                if text is None:
                    return
            elif self._mode == "between":
                text = self._feed_between(text)
            else:
                self._text(text)
                return

    def _lead_state(self, lead: str) -> str:
        """ "call" when `lead` ends with the `{` opening a call, "more" while it may still lead to one, else "no"."""
        body = lead.lstrip(WHITESPACE)
        if not self.num_calls:
            if body.startswith(PYTHON_TAG):
                body = body[len(PYTHON_TAG) :].lstrip(WHITESPACE)
            elif PYTHON_TAG.startswith(body):
                return "more"
        if not body:
            return "more"
        return "call" if body == "{" else "no"

    def _feed_lead(self, text: str) -> str:
        for i, char in enumerate(text):
            state = self._lead_state(self._lead + char)
            if state == "more":
                self._lead += char
                continue
            if state == "call":
                self._hold(self._lead)
                self._lead = ""
                self._mode = "call"
                self._new_call_object(args_keys=ARGS_KEYS)
                return text[i:]
            self._break(self._lead + text[i:])
            return ""
        return ""

    def _feed_between(self, text: str) -> str:
        """After a call: whitespace, then `;` and the next call, or the end; other text is content."""
        for i, char in enumerate(text):
            if char in WHITESPACE:
                self._ws += char
            elif char == ";":
                self._ws = ""
                self._mode = "lead"
                return text[i + 1 :]
            else:
                self._mode = "trailing"
                return text[i:]
        return ""

    def _end(self) -> None:
        if self._mode == "call":
            self._break()
        elif self._mode == "lead" and (not self.num_calls or self._lead.strip(WHITESPACE)):
            self._break(self._lead)  # no call at all: the output is content; or a dangling `;` with text after it
        self._ws = self._lead = ""
