"""POST /v1/responses: OpenAI's Responses API over the chat machinery, a `response` object or typed SSE events out.

The request becomes a chat conversation (`responses_protocol.conversation`), rendered and tokenized by
`chat_prompt_ids`, sampled with chat's `to_sampling_params` and limits, and run as one choice (`build_choices`,
`run_choices`). `ResponseBuilder` folds the choice's deltas into output items and, when streaming, into OpenAI's
event sequence: `response.created`, `response.in_progress`, per item `response.output_item.added` ...
`response.output_item.done`, and `response.completed` (or `response.incomplete` when max_output_tokens cut it
short), each `event: <type>\\ndata: <json>\\n\\n` with a `sequence_number`. Non-streamed responses run through the
same builder, so both carry the same items. An error after the stream has started is an `error` event.

tokenmill stores nothing: every response is answered as with `store: false` (vLLM's default, without
VLLM_ENABLE_RESPONSES_API_STORE), and the routes that read stored responses answer 404.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from tokenmill.frontend.context import ServingContext, read_body
from tokenmill.frontend.errors import APIError
from tokenmill.frontend.generation import Choice, build_choices, request_deadline, run_choices, usage_info
from tokenmill.frontend.limits import check_sampling_limits, json_depth_exceeds
from tokenmill.frontend.logprobs import TokenTexts, chat_logprobs
from tokenmill.frontend.outputs import ChoiceDelta
from tokenmill.frontend.protocol import (
    ChatLogprobEntry,
    decode_request,
    encode_json,
    now,
    resolve_max_tokens,
    to_sampling_params,
)
from tokenmill.frontend.reasoning_parsers import ReasoningParser
from tokenmill.frontend.responses_protocol import (
    RESPONSES_RULES,
    FunctionCallOutput,
    FunctionTool,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOutput,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormat,
    chat_tool_view,
    chat_tools,
    check_metadata,
    conversation,
    function_tools,
    logprobs_requested,
    named_tool_choice,
    sampling_request,
    text_format_constraint,
)
from tokenmill.frontend.serving_chat import chat_prompt_ids
from tokenmill.frontend.sse import open_event_stream
from tokenmill.frontend.structured_outputs import checked_constraint, requested_structured_outputs
from tokenmill.frontend.tool_choice import apply_tool_plan, plan_tool_calling
from tokenmill.frontend.tool_parsers import StreamDelta, ToolCallDelta, ToolParser
from tokenmill.frontend.unsupported import refuse_unsupported
from tokenmill.logs import request_id_var
from tokenmill.messages import SamplingParams, StructuredOutputsParams

log = logging.getLogger("tokenmill.frontend")

NOT_STORED = (
    "tokenmill does not store responses (each is answered as with store=false), so none can be "
    "retrieved, deleted or cancelled"
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(ctx: ServingContext, http_request: web.Request) -> web.StreamResponse:
    received_at = time.monotonic()
    ctx.require_task("generate", http_request)
    request: ResponsesRequest = decode_request(await read_body(http_request), ResponsesRequest)
    target = ctx.resolve_model(request.model)
    refuse_unsupported(request, RESPONSES_RULES)
    check_free_form_depth(request, ctx.config.server.max_json_depth)
    check_metadata(request.metadata)
    logprobs = logprobs_requested(request)
    tools = function_tools(request)
    if named_tool_choice(request, tools) is not None and (
        request.structured_outputs is not None or (request.text is not None and request.text.format.type != "text")
    ):
        raise APIError(
            400,
            "tool_choice 'required' or a named function is enforced with structured outputs, so "
            "it cannot be combined with text.format or structured_outputs (one constraint per "
            "request).",
            "tool_choice",
        )
    plan = plan_tool_calling(chat_tool_view(request, tools), ctx.config.server)
    messages, continue_final = conversation(request)
    sampling = sampling_request(request)
    check_sampling_limits(sampling, ctx.config.server, logprobs=request.top_logprobs, logprobs_param="top_logprobs")
    constraint = await output_constraint(ctx, request)
    prompt_ids = await chat_prompt_ids(
        ctx,
        messages,
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
        tools=chat_tools(tools),
        template_kwargs=request.chat_template_kwargs,
    )
    try:
        max_tokens = resolve_max_tokens(request.max_output_tokens, len(prompt_ids), ctx.max_model_len, "input")
    except APIError as exc:
        raise APIError(
            exc.status, exc.message, "max_output_tokens" if exc.param == "max_tokens" else exc.param
        ) from exc
    params = to_sampling_params(
        sampling,
        max_tokens=max_tokens,
        logprobs=logprobs,
        vocab_size=ctx.vocab_size,
        defaults=ctx.config.model.generation_defaults,
    )
    params.structured_outputs = constraint
    plan = await apply_tool_plan(ctx, plan, params, prompt_ids)
    ctx.admission.check(ctx.engine, 1)
    response_id = new_id("resp")
    request_id_var.set(response_id)  # this handler's log lines carry it (tokenmill/logs.py)
    choices = build_choices(
        ctx.tokenizer,
        response_id,
        [prompt_ids],
        [params],
        1,
        received_at=received_at,
        priority=request.priority,
        cache_salt=request.cache_salt,
        deadline=request_deadline(received_at, request.timeout, ctx.config.scheduler.request_timeout_s),
        lora_request=target.lora_request,
    )
    deltas = run_choices(ctx.engine, choices, ctx.metrics, ctx.admission)
    builder = ResponseBuilder(
        ctx,
        request,
        response_id,
        choices,
        params,
        tools,
        emit=request.stream,
        reasoning_parser=plan.new_reasoning_parser(),
        tool_parser=plan.new_tool_parser(),
        parallel_tool_calls=plan.parallel,
    )
    if request.stream:
        return await stream_events(http_request, deltas, builder)
    async with aclosing(deltas):
        async for delta in deltas:
            builder.add(delta)
    return web.Response(body=encode_json(builder.finish()), content_type="application/json")


def check_free_form_depth(request: ResponsesRequest, max_depth: int) -> None:
    """--max-json-depth over the request's free-form JSON (input items, tools, tool_choice, template kwargs)."""
    for param in ("input", "tools", "tool_choice", "chat_template_kwargs", "structured_outputs"):
        if json_depth_exceeds(getattr(request, param), max_depth):
            raise APIError(400, f"{param} is nested more than {max_depth} levels deep (--max-json-depth).", param)


async def output_constraint(ctx: ServingContext, request: ResponsesRequest) -> StructuredOutputsParams | None:
    """`text.format` (or vLLM's `structured_outputs`, not both) as a structured-outputs constraint, compiled once
    on a template thread so that an invalid schema is a 400 here rather than a failed generation."""
    from_text = text_format_constraint(request, ctx.config.server.max_json_depth)
    if from_text is not None and request.structured_outputs is not None:
        raise APIError(400, "Set either text.format or structured_outputs, not both.", "structured_outputs")
    if from_text is not None:
        found = from_text, "text.format.schema" if from_text.json is not None else "text.format"
    else:
        found = requested_structured_outputs(request)
    return await checked_constraint(ctx, found)


async def stream_events(http_request: web.Request, deltas: Any, builder: ResponseBuilder) -> web.StreamResponse:
    """The SSE stream. Headers wait for the first delta, so a request the engine refuses still gets a plain JSON
    error with its status; a failure after that is an `error` event. A client that goes away ends the stream,
    which closes the deltas and so aborts the engine request."""
    async with aclosing(deltas):
        first = await anext(deltas)
        response = await open_event_stream(http_request)
        try:
            try:
                builder.start()
                delta: ChoiceDelta | None = first
                while delta is not None:
                    builder.add(delta)
                    await response.write(builder.take_events())
                    delta = await anext(deltas, None)
                builder.finish()
            except APIError as error:
                builder.error(error)
            await response.write(builder.take_events())
            await response.write_eof()
        except ConnectionResetError:
            log.debug("client went away during %s", http_request.path)
    return response


class ResponseBuilder:
    """Folds a choice's deltas into the response's output items, and (with `emit`) into its SSE events.

    Output text is split by the reasoning parser (thinking becomes a `reasoning` item) and then by the tool parser
    (calls become `function_call` items, the rest the assistant `message`). At most one item is open at a time: text
    of another kind closes it and opens the next, as OpenAI streams items one after another. Streamed calls come
    from the tool parser's streaming interface; a whole response reads the calls from the whole text (`extract`),
    as chat does, so a call found malformed only at the end leaves the whole text as the message."""

    def __init__(
        self,
        ctx: ServingContext,
        request: ResponsesRequest,
        response_id: str,
        choices: list[Choice],
        params: SamplingParams,
        tools: list[FunctionTool],
        *,
        emit: bool,
        reasoning_parser: ReasoningParser | None = None,
        tool_parser: ToolParser | None = None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.ctx = ctx
        self.request = request
        self.response_id = response_id
        self.model_name = request.model or ctx.model_name  # the base, or the LoRA adapter it named
        self.choices = choices
        self.params = params
        self.tools = tools
        self.emit = emit
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.parallel_tool_calls = parallel_tool_calls  # False: only the first call is kept, as chat does
        self.created_at = now()
        self.sequence_number = 0
        self.events: list[bytes] = []
        self.output: list[Any] = []  # the output items so far, in order
        self.current: Any = None  # the open item (the last of `output`), or None
        self.unparsed = ""  # a whole response's content, read for tool calls at the end
        self.texts = TokenTexts(ctx.tokenizer)
        self.num_top = request.top_logprobs or 0
        self.pending_logprobs: list[ChatLogprobEntry] = []  # of tokens whose text has not been sent yet
        self.num_reasoning_tokens = 0
        self.finish_reason: str | None = None

    # ------------------------------------------------------------------------------------------ events

    def _event(self, type_: str, **fields: Any) -> None:
        if self.emit:
            payload = encode_json({"type": type_, "sequence_number": self.sequence_number, **fields})
            self.events.append(b"event: " + type_.encode() + b"\ndata: " + payload + b"\n\n")
        self.sequence_number += 1

    def take_events(self) -> bytes:
        events, self.events = self.events, []
        return b"".join(events)

    def start(self) -> None:
        snapshot = self.response("in_progress")
        self._event("response.created", response=snapshot)
        self._event("response.in_progress", response=snapshot)

    def error(self, error: APIError) -> None:
        """An error after the stream began, as OpenAI's `error` event (the status code as `code`)."""
        self._event("error", code=str(error.status), message=error.message, param=error.param)

    # ------------------------------------------------------------------------------------------ routing text

    def add(self, delta: ChoiceDelta) -> None:
        if delta.logprobs and self.params.logprobs is not None:
            self.pending_logprobs += (
                chat_logprobs(delta.token_ids, delta.logprobs, self.texts, self.num_top).content or []
            )
        parser = self.reasoning_parser
        if parser is not None and not parser.reasoning_ended:
            self.num_reasoning_tokens += len(delta.token_ids)  # tokens sampled while thinking (its end included)
        if delta.text:
            if parser is not None:
                split = parser.extract_streaming(delta.text)
                self._reasoning(split.reasoning)
                self._answer(split.content)
            else:
                self._answer(delta.text)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    def _answer(self, text: str) -> None:
        """Text after the thinking: content, or tool calls when a tool parser reads it."""
        if not text:
            return
        if self.tool_parser is None:
            self._content(text)
        elif not self.emit:
            self.unparsed += text
        else:
            self._parsed(self.tool_parser.extract_streaming(text))

    def _parsed(self, delta: StreamDelta) -> None:
        if delta.content:
            self._content(delta.content)
        for piece in delta.tool_calls:
            if self.parallel_tool_calls or piece.index == 0:
                self._call(piece)

    def _flush(self) -> None:
        """The output has ended: what the parsers held back, then (for a whole response) the calls."""
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.finish()
            self._reasoning(split.reasoning)
            self._answer(split.content)
        if self.tool_parser is None:
            return
        if self.emit:
            self._parsed(self.tool_parser.finish())
            return
        extracted = self.tool_parser.extract(self.unparsed)
        if extracted.content:
            self._content(extracted.content)
        for call in extracted.tool_calls if self.parallel_tool_calls else extracted.tool_calls[:1]:
            self._call(ToolCallDelta(index=0, arguments=call.arguments, id=call.id, name=call.name))

    # ------------------------------------------------------------------------------------------ items

    def _open(self, item: Any) -> int:
        self._close("completed")
        self.output.append(item)
        self.current = item
        self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        return len(self.output) - 1

    def _close(self, status: str) -> None:
        item = self.current
        if item is None:
            return
        index = len(self.output) - 1
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.logprobs += self.pending_logprobs  # an EOS token ends the list, as in chat
            self.pending_logprobs = []
            self._event(
                "response.output_text.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=part.logprobs,
            )
            self._event("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part)
        elif isinstance(item, ReasoningOutput):
            part = item.content[0]
            self._event(
                "response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0, text=part.text
            )
            self._event("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part)
        else:
            self._event(
                "response.function_call_arguments.done", item_id=item.id, output_index=index, arguments=item.arguments
            )
        item.status = status
        self._event("response.output_item.done", output_index=index, item=item)
        self.current = None

    def _content(self, text: str) -> None:
        message = self.current
        if not isinstance(message, OutputMessage):
            message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
            index = self._open(message)
            part = OutputText(text="")
            self._event(
                "response.content_part.added", item_id=message.id, output_index=index, content_index=0, part=part
            )
            message.content.append(part)
        part = message.content[0]
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        part.text += text
        part.logprobs += logprobs
        self._event(
            "response.output_text.delta",
            item_id=message.id,
            output_index=len(self.output) - 1,
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def _reasoning(self, text: str) -> None:
        if not text:
            return
        self.pending_logprobs = []  # logprobs are reported for the message's text only
        item = self.current
        if not isinstance(item, ReasoningOutput):
            item = ReasoningOutput(id=new_id("rs"), status="in_progress", content=[])
            index = self._open(item)
            part = ReasoningText(text="")
            self._event("response.content_part.added", item_id=item.id, output_index=index, content_index=0, part=part)
            item.content.append(part)
        item.content[0].text += text
        self._event(
            "response.reasoning_text.delta",
            item_id=item.id,
            output_index=len(self.output) - 1,
            content_index=0,
            delta=text,
        )

    def _call(self, piece: ToolCallDelta) -> None:
        self.pending_logprobs = []
        item = self.current
        if piece.name is not None:  # a call's first piece
            item = FunctionCallOutput(
                id=new_id("fc"), call_id=piece.id or new_id("call"), name=piece.name, arguments="", status="in_progress"
            )
            self._open(item)
        if not isinstance(item, FunctionCallOutput) or not piece.arguments:
            return
        item.arguments += piece.arguments
        self._event(
            "response.function_call_arguments.delta",
            item_id=item.id,
            output_index=len(self.output) - 1,
            delta=piece.arguments,
        )

    def finish(self) -> ResponseObject:
        """Close the open item and send (or return) the final response."""
        self._flush()
        incomplete = self.finish_reason == "length"
        self._close("incomplete" if incomplete else "completed")
        final = self.response("incomplete" if incomplete else "completed")
        self._event("response.incomplete" if incomplete else "response.completed", response=final)
        return final

    def usage(self) -> ResponseUsage:
        usage = usage_info(self.choices)
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self.num_reasoning_tokens),
            total_tokens=usage.total_tokens,
        )

    def response(self, status: str) -> ResponseObject:
        request = self.request
        done = status != "in_progress"
        text_format = request.text.format if request.text is not None else TextFormat(type="text")
        return ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            status=status,
            completed_at=now() if status == "completed" else None,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            model=self.model_name,
            output=list(self.output) if done else [],
            parallel_tool_calls=request.parallel_tool_calls,
            temperature=self.params.temperature,
            text=TextConfig(format=text_format, verbosity="medium"),
            tool_choice=request.tool_choice,
            tools=self.tools,
            top_logprobs=request.top_logprobs or 0,
            top_p=self.params.top_p,
            usage=self.usage() if done else None,
            user=request.user,
            metadata=request.metadata or {},
            prompt_cache_key=request.prompt_cache_key,
            safety_identifier=request.safety_identifier,
        )


async def response_not_stored(ctx: ServingContext, http_request: web.Request) -> web.StreamResponse:
    """GET / DELETE /v1/responses/{id} (and its cancel and input_items): nothing is stored, so always a 404."""
    response_id = http_request.match_info.get("response_id", "")
    raise APIError(404, f"Response with id {response_id!r} not found: {NOT_STORED}.", "response_id")
