"""A chat choice's output read as vLLM's /v1/chat/completions reads it: reasoning split off first (with a reasoning
parser), tool calls read from the content after it (`frontend/tool_choice.py` plans which parser), and the OpenAI
message or stream delta built from the parts.

`ChatOutputs` serves one response: `whole(summary)` gives a choice's message and finish reason, `stream(delta)` the
delta message of a streamed step (the choice's parsers flush on its last step). A choice that called tools finishes
with "tool_calls" when the engine stopped it (a "length" cut stays "length", so a truncated call shows as one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.frontend.outputs import ChoiceDelta, CompletionOutput
from tokenmill.frontend.protocol import (
    AssistantMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tokenmill.frontend.tool_choice import ToolPlan
from tokenmill.frontend.tool_parsers import StreamDelta, ToolCallDelta


def finish_reason(engine_reason: str | None, tools_called: bool) -> str | None:
    return "tool_calls" if tools_called and engine_reason == "stop" else engine_reason


@dataclass
class Parts:
    """What one step (or a whole output) adds: reasoning, content and tool-call deltas."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceParsing:
    """One choice's parsers, fed its text in order."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.reasoning = plan.new_reasoning_parser()
        self.tools = plan.new_tool_parser()
        self.tools_called = False

    def feed(self, text: str, last: bool) -> Parts:
        parts = Parts()
        if self.reasoning is not None:
            self._add_reasoning(parts, self.reasoning.extract_streaming(text))
            if last:
                self._add_reasoning(parts, self.reasoning.finish())
        else:
            self._add_content(parts, text)
        if last and self.tools is not None:
            self._add_tools(parts, self.tools.finish())
        return parts

    def _add_reasoning(self, parts: Parts, delta) -> None:
        parts.reasoning += delta.reasoning
        self._add_content(parts, delta.content)

    def _add_content(self, parts: Parts, text: str) -> None:
        if self.tools is None:
            parts.content += text
        elif text:
            self._add_tools(parts, self.tools.extract_streaming(text))

    def _add_tools(self, parts: Parts, delta: StreamDelta) -> None:
        parts.content += delta.content
        calls = [c for c in delta.tool_calls if self.plan.parallel or c.index == 0]
        parts.tool_calls.extend(calls)
        self.tools_called = self.tools_called or bool(calls)


class ChatOutputs:
    """The messages of one response's choices (see the module docstring)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.choices: dict[int, ChoiceParsing] = {}

    def whole(self, summary: CompletionOutput) -> tuple[AssistantMessage, str | None]:
        plan = self.plan
        if not plan.parses_output:
            return AssistantMessage(content=summary.text), summary.finish_reason
        reasoning: str | None = None
        content = summary.text
        parser = plan.new_reasoning_parser()
        if parser is not None:
            reasoning, content = parser.extract(content)
        message = AssistantMessage(content=content)
        tools = plan.new_tool_parser()
        calls = []
        if tools is not None:
            extracted = tools.extract(content)
            calls = extracted.tool_calls if plan.parallel else extracted.tool_calls[:1]
            message.content = extracted.content
            if calls:
                message.tool_calls = [
                    ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
                ]
        if parser is not None:
            message.reasoning_content = reasoning
            if message.content == "" and reasoning is not None:
                message.content = None
        return message, finish_reason(summary.finish_reason, bool(calls))

    def stream(self, delta: ChoiceDelta) -> tuple[DeltaMessage, str | None]:
        if not self.plan.parses_output:
            return (DeltaMessage(content=delta.text) if delta.text else DeltaMessage()), delta.finish_reason
        choice = self.choices.get(delta.index)
        if choice is None:
            choice = self.choices[delta.index] = ChoiceParsing(self.plan)
        parts = choice.feed(delta.text, delta.finish_reason is not None)
        message = DeltaMessage()
        if parts.reasoning:
            message.reasoning_content = parts.reasoning
        if parts.content:
            message.content = parts.content
        if parts.tool_calls:
            message.tool_calls = [delta_tool_call(c) for c in parts.tool_calls]
        return message, finish_reason(delta.finish_reason, choice.tools_called)


def delta_tool_call(piece: ToolCallDelta) -> DeltaToolCall:
    if piece.id is None:
        return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
    return DeltaToolCall(
        index=piece.index,
        id=piece.id,
        type="function",
        function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
    )


def is_empty(message: DeltaMessage) -> bool:
    return message == DeltaMessage()
