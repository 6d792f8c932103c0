"""A chat request's tool calling and reasoning, checked and planned before it reaches the engine, as vLLM does it.

- `tools` are rendered into the prompt by the chat template whatever `tool_choice` is (vLLM's default).
- `tool_choice` defaults to "auto" when tools are given, else "none". "none" never parses calls. "auto" parses the
  output with `--tool-call-parser`, and needs it and `--enable-auto-tool-choice`: without them a request with tools
  and tool_choice "auto" (given or by default) is a 400, as vLLM answers it.
- "required" and a named function are enforced by structured outputs: the output is constrained to a JSON list of
  `{"name", "parameters"}` objects (at least one; `anyOf` the tools) or to the named function's parameters schema,
  and read as that JSON (`tool_parsers/forced.py`). A named function that is not among `tools`, or either without
  tools, is a 400; so is either together with `response_format` / `structured_outputs` / `guided_*` (one
  constraint per request). "required" with an empty tools list is "none", as vLLM.
- `parallel_tool_calls: false` keeps only the first call (and limits "required" to one call).
- With `--reasoning-parser`, output is split into reasoning and content, and tool calls are read from the content.
  While the model thinks, a structured-output constraint waits: `begin_after_token_ids` is the end-of-thinking
  marker's ids (None when thinking is off: `enable_thinking: false`, or a prompt that closes the thinking).
- An assistant message's `tool_calls[].function.arguments` (a JSON string) is parsed into an object before rendering,
  as vLLM does, for templates that `tojson` it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.frontend.errors import APIError
from tokenmill.frontend.reasoning_parsers import (
    ReasoningParser,
    end_marker_ids,
    get_reasoning_parser,
    thinking_closed_by_prompt,
)
from tokenmill.frontend.structured_outputs import check_structured_outputs
from tokenmill.frontend.tool_parsers import NamedToolCallParser, RequiredToolCallsParser, ToolParser, get_tool_parser
from tokenmill.messages import SamplingParams, StructuredOutputsParams

CONSTRAINT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How a request's outputs are read: `mode` none | auto | named | required."""

    mode: str = "none"
    function_name: str | None = None
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    thinking: bool = True
    parallel: bool = True
    schema: dict[str, Any] | None = None  # the forced modes' constraint

    @property
    def parses_output(self) -> bool:
        return self.mode != "none" or self.reasoning_parser is not None

    def new_tool_parser(self) -> ToolParser | None:
        """A parser for one choice's output, or None when tool calls are not read."""
        if self.mode == "auto":
            return self.tool_parser()
        if self.mode == "named":
            return NamedToolCallParser(self.function_name)
        if self.mode == "required":
            return RequiredToolCallsParser()
        return None

    def new_reasoning_parser(self) -> ReasoningParser | None:
        return self.reasoning_parser(thinking=self.thinking) if self.reasoning_parser else None


def plan_tool_calling(request: Any, server: Any) -> ToolPlan:
    """The plan for a chat request (400s for what cannot be honoured), before its prompt is rendered."""
    tools = function_tools(request.tools)
    reasoning = get_reasoning_parser(server.reasoning_parser) if server.reasoning_parser else None
    thinking = (request.chat_template_kwargs or {}).get("enable_thinking") is not False
    plan = ToolPlan(reasoning_parser=reasoning, thinking=thinking, parallel=request.parallel_tool_calls is not False)
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return plan
    if request.tools is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto":
        if not (server.enable_auto_tool_choice and server.tool_call_parser):
            raise APIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        return replace(plan, mode="auto", tool_parser=get_tool_parser(server.tool_call_parser)) if tools else plan
    if choice == "required":
        if not tools:
            return plan
        return _forced(request, replace(plan, mode="required", schema=required_schema(tools, plan.parallel)))
    name = _named_function(choice)
    if name not in tools:
        raise APIError(
            400,
            f"The function {name!r} in `tool_choice` is not among the request's `tools` "
            f"({', '.join(tools) or 'none'}).",
            "tool_choice",
        )
    return _forced(request, replace(plan, mode="named", function_name=name, schema=tools[name]))


def _named_function(choice: Any) -> str:
    if isinstance(choice, dict):
        function = choice.get("function")
        if (
            choice.get("type", "function") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and function["name"]
        ):
            return function["name"]
    raise APIError(
        400,
        'Invalid `tool_choice`: it must be "none", "auto", "required" or {"type": "function", '
        '"function": {"name": ...}} naming one of the tools.',
        "tool_choice",
    )


def _forced(request: Any, plan: ToolPlan) -> ToolPlan:
    response_format = getattr(request, "response_format", None)
    others = [f for f in CONSTRAINT_FIELDS if getattr(request, f, None) is not None]
    if response_format is not None and response_format != {"type": "text"}:
        others.insert(0, "response_format")
    if others:
        raise APIError(
            400,
            f"tool_choice {'required' if plan.mode == 'required' else 'naming a function'} is "
            f"enforced with structured outputs, so it cannot be combined with {others[0]} (one "
            f"constraint per request).",
            "tool_choice",
        )
    return plan


def function_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each tool's name -> its parameters schema (an empty object's when it has none); 400 naming a malformed one."""
    found: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, 'Each tool must be {"type": "function", "function": {...}}.', f"tools[{i}].type")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(
                400, "A tool's `function` must be an object with a non-empty `name`.", f"tools[{i}].function"
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(
                400, "A function's `parameters` must be a JSON schema object.", f"tools[{i}].function.parameters"
            )
        found[function["name"]] = parameters or EMPTY_PARAMETERS
    return found


def required_schema(tools: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a list (at least one item) of calls, each {name, parameters} of one
    of the tools; each schema's `$defs` move to the top, where its `$ref`s point."""
    definitions: dict[str, Any] = {}
    variants = []
    for name, parameters in tools.items():
        parameters = copy.deepcopy(parameters)
        for key, definition in (parameters.pop("$defs", None) or {}).items():
            if definitions.setdefault(key, definition) != definition:
                raise APIError(
                    400,
                    f"Tools define `$defs` {key!r} differently; tool_choice required needs one definition of each.",
                    "tools",
                )
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


async def apply_tool_plan(ctx: Any, plan: ToolPlan, params: SamplingParams, prompt_ids: list[int]) -> ToolPlan:
    """Set what the plan needs on the choice's sampling params (a forced call's constraint; when to start
    constraining after thinking; special tokens kept for the parser), once the prompt is known."""
    if plan.reasoning_parser is not None and plan.thinking:
        if thinking_closed_by_prompt(plan.reasoning_parser, ctx.tokenizer, prompt_ids):
            plan = replace(plan, thinking=False)
    if plan.schema is not None:
        constraint = StructuredOutputsParams(json=json.dumps(plan.schema))
        params.structured_outputs = await ctx.offload.render(
            check_structured_outputs, constraint, "tools", ctx.config.server.max_structured_outputs_bytes
        )
    if params.structured_outputs is not None and plan.reasoning_parser is not None and plan.thinking:
        params.structured_outputs.begin_after_token_ids = end_marker_ids(plan.reasoning_parser, ctx.tokenizer)
    if plan.tool_parser is not None and plan.tool_parser.keeps_special_tokens:
        params.skip_special_tokens = False
    return plan


def tool_calls_for_template(tool_calls: Any, message_index: int) -> Any:
    """An assistant message's tool calls with each `function.arguments` JSON string parsed into an object (empty
    arguments: {}), as vLLM passes them to chat templates; a copy. 400 naming a malformed call."""
    if not isinstance(tool_calls, list):
        return tool_calls
    parsed = []
    for j, call in enumerate(tool_calls):
        where = f"messages[{message_index}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise APIError(400, "A tool call must be an object with a `function` object.", f"{where}.function")
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as exc:
                raise APIError(
                    400, f"A tool call's arguments must be JSON: {exc}", f"{where}.function.arguments"
                ) from None
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed
