"""Tool-call parsers: the calls a model writes in its output text, as OpenAI's `tool_calls`, whole or streamed.

Public API (used by /v1/chat/completions and /v1/responses):

    from tokenmill.frontend.tool_parsers import get_tool_parser, tool_parser_names

    parser_class = get_tool_parser("hermes")   # KeyError naming the choices for an unknown name
    parser = parser_class()                    # one object per response choice (it keeps streaming state)

    result = parser.extract(text)              # a whole output: ExtractedToolCalls(content, tool_calls)
    for piece in pieces:                       # or streamed: the text deltas in order
        delta = parser.extract_streaming(piece)    # StreamDelta(content, tool_calls=[ToolCallDelta, ...])
    delta = parser.finish()                    # once the output has ended: what was held back

A `ToolCall` has `id` ("chatcmpl-tool-" + 32 hex digits; 9 alphanumerics for mistral), `name` and `arguments` (a
JSON text). A `ToolCallDelta` has the call's `index`; the first delta of a call carries its `id` and `name` (and the
arguments so far, possibly ""), later ones further `arguments` fragments. The deltas of any chunking reassemble
(`fold`) into exactly what `extract` returns for the whole text, for every well-formed output (see `base.py` for
malformed ones). A parser class with `keeps_special_tokens` needs the output detokenized with special tokens.

Parsers (vLLM's names): `hermes` (Qwen2.5, Qwen3, Hermes: `<tool_call>{json}</tool_call>`), `llama3_json`
(`{"name": ..., "parameters": ...}`), `mistral` (`[TOOL_CALLS]`), `pythonic` (`[f(a=1), g(b="x")]`). The outputs
of a forced tool_choice are read by `NamedToolCallParser` and `RequiredToolCallsParser` (`forced.py`).
"""

from __future__ import annotations

from tokenmill.frontend.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    fold,
    random_tool_call_id,
)
from tokenmill.frontend.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser
from tokenmill.frontend.tool_parsers.hermes import HermesToolParser
from tokenmill.frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenmill.frontend.tool_parsers.mistral import MistralToolParser
from tokenmill.frontend.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def tool_parser_names() -> list[str]:
    return sorted(TOOL_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; KeyError (naming the choices) for any other name."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r} (choose from {', '.join(tool_parser_names())})") from None


__all__ = [
    "ExtractedToolCalls",
    "NamedToolCallParser",
    "RequiredToolCallsParser",
    "StreamDelta",
    "TOOL_PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "fold",
    "get_tool_parser",
    "random_tool_call_id",
    "tool_parser_names",
]
