"""OpenAI's Responses API (`POST /v1/responses`) as msgspec Structs, and a request's translation into what the chat
machinery already runs: a conversation of `ChatMessage`s, tools in chat's nested shape, a `SamplingRequest` and a
structured-outputs constraint.

The request is decoded as the other endpoints' are (`decode_request`: unknown fields ignored, declared ones typed).
Input items and tools are decoded one at a time, by their `type`, so that an error names the item
(`input[2].call_id`). Fields tokenmill cannot honour are refused with a 400 naming them (`RESPONSES_RULES`,
checked by `frontend/unsupported.py`), never silently ignored. tokenmill keeps no server-side state: every response
is answered as OpenAI answers `store: false`, so `previous_response_id` and background runs are refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from tokenmill.frontend.errors import APIError, validation_error
from tokenmill.frontend.limits import json_depth_exceeds
from tokenmill.frontend.protocol import (
    INT64_MAX,
    ChatLogprobEntry,
    ChatMessage,
    Int64,
    NonNegativeInt,
    Penalty,
    PositiveInt,
    SamplingRequest,
    TextPart,
    Timeout,
)
from tokenmill.messages import StructuredOutputsParams

# what OpenAI allows in `metadata`
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PART_TYPES = ("input_text", "output_text", "text")


# ---------------------------------------------------------------------------------------------- request


class TextFormat(Struct, kw_only=True, omit_defaults=True):
    """`text.format`: plain text, a JSON schema, or any JSON object."""

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=lambda: TextFormat(type="text"))
    verbosity: str | None = None  # only OpenAI's default ("medium") is honoured: tokenmill cannot change it


class ResponsesRequest(Struct, kw_only=True):
    """A `POST /v1/responses` body: OpenAI's fields, plus the vLLM sampling extensions chat takes."""

    input: str | list[dict[str, Any]]  # a user message, or input items (decoded one by one in `conversation`)
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_logprobs: NonNegativeInt | None = None
    include: list[str] | None = None
    stream: bool = False
    store: bool = True  # answered as false: nothing is kept (echoed as false)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint for OpenAI's caches; tokenmill's prefix cache needs none
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    text: TextConfig | None = None
    truncation: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # vLLM extensions (as in its ResponsesRequest and chat)
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    cache_salt: str | None = None
    timeout: Timeout | None = None  # seconds from arrival: then it ends with what it has (as chat's `timeout`)
    chat_template_kwargs: dict[str, Any] | None = None  # only the variables the template reads
    structured_outputs: Any = None  # vLLM's constraint object (frontend/structured_outputs.py); not with text.format
    # not implemented: refused when set (RESPONSES_RULES)
    previous_response_id: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None


def _set(value: Any, request: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {} and value != ""


# field -> (is it used?, why tokenmill refuses it); checked by `refuse_unsupported(request, RESPONSES_RULES)`
RESPONSES_RULES: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "previous_response_id": (
        _set,
        "tokenmill does not store responses (every response is answered as with "
        "store=false), so none can be continued; send the earlier items in `input`",
    ),
    "background": (_set, "background responses need stored responses, and tokenmill stores none"),
    "conversation": (
        _set,
        "conversations need stored state, and tokenmill stores none; send the earlier items in `input`",
    ),
    "prompt": (_set, "prompt templates are not implemented"),
    "reasoning": (
        lambda value, request: (
            value is not None and (not isinstance(value, dict) or any(v is not None for v in value.values()))
        ),
        "reasoning options (effort, summary) do nothing on this server: the chat template and the "
        "reasoning parser decide",
    ),
    "max_tool_calls": (
        lambda value, request: value is not None,
        "max_tool_calls limits built-in tool calls, which tokenmill does not run",
    ),
    "context_management": (_set, "context management (compaction) is not implemented"),
    "moderation": (_set, "moderation is not implemented"),
    "truncation": (
        lambda value, request: value not in (None, "disabled"),
        "only truncation 'disabled' is implemented (an input too long for the model is a 400)",
    ),
    "service_tier": (
        lambda value, request: value not in (None, "auto", "default"),
        "this server has one service tier ('default')",
    ),
    "stream_options": (
        lambda value, request: bool(value) and bool(value.get("include_obfuscation")),
        "stream obfuscation is not implemented",
    ),
}


# input items, each decoded by its `type`


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(Struct, kw_only=True):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(Struct, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Struct, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningInputItem(Struct, kw_only=True):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


ITEM_TYPES: dict[str, type] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningInputItem,
}


class FunctionTool(Struct, kw_only=True):
    """A function tool in the Responses API's flat shape (echoed in the response as given)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


_PATH_AT_END = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


def convert(value: Any, type_: type, param: str) -> Any:
    """`value` (a decoded dict) as `type_`; a mismatch is a 400 naming the field below `param`."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        inner = validation_error(exc).param
        where = f"{param}.{inner}" if inner else param
        message = _PATH_AT_END.sub("", str(exc))
        raise APIError(400, f"Invalid request: {message} - at `{where}`", where) from None


def _text_of_parts(parts: str | list[ContentPart], param: str) -> str | list[TextPart]:
    """Text content as chat takes it: a string, or text parts (chat joins them with newlines)."""
    if isinstance(parts, str):
        return parts
    texts: list[TextPart] = []
    for j, part in enumerate(parts):
        if part.type in TEXT_PART_TYPES and part.text is not None:
            texts.append(TextPart(type="text", text=part.text))
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(TextPart(type="text", text=part.refusal))
        else:
            raise APIError(
                400,
                f"Unsupported content part type {part.type!r}: this model takes text only (input_text, output_text).",
                f"{param}[{j}].type",
            )
    return texts


def conversation(request: ResponsesRequest) -> tuple[list[ChatMessage], bool]:
    """The chat conversation of a request, and whether to continue its last (partial assistant) message.

    As vLLM: `instructions` is a system message first; a string input is one user message; a `function_call` item
    is an assistant tool call (joining the assistant message just before it), a `function_call_output` item a
    tool message; an assistant message whose status is in_progress or incomplete, last, is continued rather than
    answered. Reasoning items are dropped: the chat template renders what it keeps of earlier turns from
    messages, and tokenmill's chat messages carry no reasoning."""
    messages: list[ChatMessage] = []
    if request.instructions:
        messages.append(ChatMessage(role="system", content=request.instructions))
    if isinstance(request.input, str):
        messages.append(ChatMessage(role="user", content=request.input))
        return messages, False
    if not request.input:
        raise APIError(400, "`input` must not be an empty list.", "input")
    continue_final = False
    for i, raw in enumerate(request.input):
        param = f"input[{i}]"
        kind = raw.get("type", "message")
        item_type = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if item_type is None:
            why = (
                "item references need stored responses, and tokenmill stores none"
                if kind == "item_reference"
                else "tokenmill takes message, function_call, function_call_output and reasoning items"
            )
            raise APIError(400, f"Input item type {kind!r} is not supported: {why}.", f"{param}.type")
        item = convert(raw, item_type, param)
        previous = messages[-1] if messages and messages[-1].role == "assistant" else None
        continue_final = False
        if isinstance(item, MessageItem):
            content = _text_of_parts(item.content, f"{param}.content")
            if item.role == "assistant" and previous is not None and previous.content is None:
                previous.content = content  # the text of an assistant turn that began with a tool call
            else:
                messages.append(ChatMessage(role=item.role, content=content))
            continue_final = item.role == "assistant" and item.status in ("in_progress", "incomplete")
        elif isinstance(item, FunctionCallItem):
            if item.arguments.strip():
                try:
                    json.loads(item.arguments)
                except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's stack
                    raise APIError(
                        400, f"A function call's arguments must be JSON: {exc}", f"{param}.arguments"
                    ) from None
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if previous is not None:
                previous.tool_calls = [*(previous.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            output = _text_of_parts(item.output, f"{param}.output")
            if not isinstance(output, str):
                output = "\n".join(part.text or "" for part in output)
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        elif item.encrypted_content is not None:
            raise APIError(
                400,
                "Encrypted reasoning content is not supported: tokenmill cannot decrypt it.",
                f"{param}.encrypted_content",
            )
    return messages, continue_final


def function_tools(request: ResponsesRequest) -> list[FunctionTool]:
    """The request's tools; anything but a function tool (web_search, file_search, mcp, ...) is a 400."""
    tools: list[FunctionTool] = []
    for i, raw in enumerate(request.tools):
        kind = raw.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"Tool type {kind!r} is not supported: tokenmill serves function tools only "
                f"(the client runs them); built-in tools (web_search, file_search, "
                f"code_interpreter, computer_use, image_generation, mcp, ...) are not "
                f"available.",
                f"tools[{i}].type",
            )
        tool = convert(raw, FunctionTool, f"tools[{i}]")
        if not tool.name:
            raise APIError(400, "A function tool needs a non-empty `name`.", f"tools[{i}].name")
        tools.append(tool)
    return tools


def chat_tools(tools: list[FunctionTool]) -> list[dict[str, Any]] | None:
    """Function tools in chat's nested shape, as chat templates read them (`strict` is dropped: it is about
    enforcement, not the prompt)."""
    if not tools:
        return None
    result = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.parameters is not None:
            function["parameters"] = tool.parameters
        result.append({"type": "function", "function": function})
    return result


def named_tool_choice(request: ResponsesRequest, tools: list[FunctionTool]) -> str | None:
    """Check `tool_choice` against the tools: None for "none"/"auto", "required", or the named function."""
    choice = request.tool_choice
    if choice in ("none", "auto"):
        return None
    if choice == "required":
        if not tools:
            raise APIError(400, "tool_choice 'required' needs `tools`.", "tool_choice")
        return "required"
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {tool.name for tool in tools}:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in `tools`.", "tool_choice")
        return name
    if isinstance(choice, str):
        raise APIError(400, f"tool_choice {choice!r} is not one of 'none', 'auto', 'required'.", "tool_choice")
    kind = choice.get("type")
    raise APIError(
        400,
        f"tool_choice of type {kind!r} is not supported: tokenmill takes 'none', 'auto', "
        f'\'required\' or a function ({{"type": "function", "name": ...}}).',
        "tool_choice.type",
    )


class ChatToolView(Struct, kw_only=True):
    """The tool fields of a Responses request in chat's shape, for `tool_choice.plan_tool_calling` (the text.format
    and structured_outputs conflicts are checked before, naming the Responses fields)."""

    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    chat_template_kwargs: dict[str, Any] | None
    response_format: None = None


def chat_tool_view(request: ResponsesRequest, tools: list[FunctionTool]) -> ChatToolView:
    """As vLLM: tool_choice "auto" (the default) or "none" without tools is "none"; a named function
    `{"type": "function", "name"}` is chat's `{"type": "function", "function": {"name"}}`."""
    choice = request.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif not tools and choice in ("auto", "none"):
        choice = "none"
    return ChatToolView(
        tools=chat_tools(tools),
        tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls,
        chat_template_kwargs=request.chat_template_kwargs,
    )


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(
            400, f"`metadata` has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed.", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise APIError(
                400,
                f"A `metadata` key is {len(key)} characters long; at most {MAX_METADATA_KEY_CHARS} are allowed.",
                "metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError(
                400,
                f"`metadata[{key!r}]` is {len(value)} characters long; at most {MAX_METADATA_VALUE_CHARS} are allowed.",
                f"metadata.{key}",
            )


def logprobs_requested(request: ResponsesRequest) -> int | None:
    """How many top logprobs to return per token (None: no logprobs). `include` may ask only for output logprobs."""
    wanted = False
    for i, entry in enumerate(request.include or []):
        if entry == LOGPROBS_INCLUDE:
            wanted = True
        else:
            raise APIError(
                400,
                f"include {entry!r} is not supported: tokenmill can include only {LOGPROBS_INCLUDE!r}.",
                f"include[{i}]",
            )
    return (request.top_logprobs or 0) if wanted else None


def text_format_constraint(request: ResponsesRequest, max_json_depth: int) -> StructuredOutputsParams | None:
    """`text.format` as a structured-outputs constraint (None for plain text)."""
    text = request.text
    if text is None:
        return None
    if text.verbosity not in (None, "medium"):
        raise APIError(
            400,
            f"text.verbosity {text.verbosity!r} is not supported: this server cannot change how "
            f"verbose the model is (only 'medium', the default, is accepted).",
            "text.verbosity",
        )
    fmt = text.format
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "json_schema":
        if not fmt.name:
            raise APIError(400, "text.format of type 'json_schema' needs a `name`.", "text.format.name")
        if fmt.schema is None:
            raise APIError(400, "text.format of type 'json_schema' needs a `schema`.", "text.format.schema")
        if json_depth_exceeds(fmt.schema, max_json_depth):
            raise APIError(
                400,
                f"text.format.schema is nested more than {max_json_depth} levels deep (--max-json-depth).",
                "text.format.schema",
            )
        return StructuredOutputsParams(json=fmt.schema)
    return None


def sampling_request(request: ResponsesRequest) -> SamplingRequest:
    """The request's sampling fields as the chat machinery takes them (`to_sampling_params`, the limits)."""
    return SamplingRequest(
        model=request.model,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stop,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=request.logit_bias,
        user=request.user,
        stream=request.stream,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=request.stop_token_ids,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        priority=request.priority,
        cache_salt=request.cache_salt,
    )


# ---------------------------------------------------------------------------------------------- response


class OutputText(Struct, kw_only=True):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[ChatLogprobEntry] = []  # OpenAI's token logprob entries have chat's shape


class OutputMessage(Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    status: str
    content: list[OutputText]


class FunctionCallOutput(Struct, kw_only=True):
    id: str
    type: str = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str


class ReasoningText(Struct, kw_only=True):
    type: str = "reasoning_text"
    text: str


class ReasoningOutput(Struct, kw_only=True):
    id: str
    type: str = "reasoning"
    summary: list[Any] = []
    content: list[ReasoningText]
    status: str


class IncompleteDetails(Struct, kw_only=True):
    reason: str


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # tokenmill's prefix cache is automatic and free: no writes are counted


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ReasoningEcho(Struct, kw_only=True):
    effort: None = None
    summary: None = None


class ResponseObject(Struct, kw_only=True):
    """The `response` object: its output and usage, and the request fields OpenAI echoes."""

    id: str
    object: str = "response"
    created_at: int
    status: str
    completed_at: int | None = None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: None = None
    model: str
    output: list[Any] = []
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: ReasoningEcho = msgspec.field(default_factory=ReasoningEcho)
    service_tier: str = "default"
    store: bool = False  # nothing is stored, whatever the request said
    temperature: float | None = None
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[FunctionTool] = []
    top_logprobs: int = 0
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}
    background: bool = False
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
