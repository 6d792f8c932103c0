"""POST /v1/chat/completions: messages through the chat template, `chat.completion` JSON or SSE chunks out."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

import jinja2
import msgspec
from aiohttp import web

from tokenmill.frontend.chat_parsing import ChatOutputs, is_empty
from tokenmill.frontend.chat_template import RENDERER_ARGS, RenderLimitError, RenderLimits, compile_chat_template
from tokenmill.frontend.context import ServingContext, new_request_id, read_body
from tokenmill.frontend.errors import APIError
from tokenmill.frontend.generation import Choice, build_choices, request_deadline, run_choices, usage_info
from tokenmill.frontend.limits import check_prompt_logprobs_budget, check_sampling_limits
from tokenmill.frontend.logprobs import TokenTexts, chat_logprobs
from tokenmill.frontend.outputs import ChoiceDelta, CompletionOutput
from tokenmill.frontend.prompt_logprobs import response_prompt_logprobs
from tokenmill.frontend.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    chat_max_tokens,
    decode_request,
    encode_json,
    now,
    resolve_max_tokens,
    to_sampling_params,
)
from tokenmill.frontend.protocol import chat_logprobs as requested_chat_logprobs
from tokenmill.frontend.sse import stream_deltas
from tokenmill.frontend.structured_outputs import structured_outputs_params
from tokenmill.frontend.tokenizer import encode_text, render_chat, server_chat_template
from tokenmill.frontend.tool_choice import ToolPlan, apply_tool_plan, plan_tool_calling, tool_calls_for_template
from tokenmill.frontend.unsupported import refuse_unsupported


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; content parts are joined into one string (text parts only)."""
    result: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"Unsupported content part type {part.type!r}: this model takes text only",
                        f"messages[{i}].content[{j}].type",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
        for name in ("name", "tool_calls", "tool_call_id"):
            value = getattr(message, name)
            if value is not msgspec.UNSET:
                entry[name] = value
        if message.role == "assistant" and "tool_calls" in entry:
            entry["tool_calls"] = tool_calls_for_template(entry["tool_calls"], i)
        result.append(entry)
    return result


# what a chat template's own code may raise on a conversation it cannot render
TEMPLATE_FAILURES = (
    jinja2.TemplateError,
    ValueError,
    TypeError,
    LookupError,
    AttributeError,
    ArithmeticError,
    RecursionError,
    MemoryError,
)


async def chat_prompt_ids(
    ctx: ServingContext,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """Render the conversation and tokenize it (the template already holds the special tokens), each on its own
    thread (`ctx.offload`). `chat_template` is the request's own template: refused unless the server trusts them."""
    check_request_template_allowed(ctx, chat_template)
    text = await ctx.offload.render(
        render_prompt,
        ctx,
        message_dicts(messages),
        tools,
        template_kwargs or {},
        chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    return await ctx.offload.tokenize(encode_text, ctx.tokenizer, text, add_special_tokens=False)


def check_request_template_allowed(ctx: ServingContext, chat_template: str | None) -> None:
    """A 400 for a request's own `chat_template` unless the server trusts them."""
    if chat_template is not None and not ctx.config.server.trust_request_chat_template:
        raise APIError(
            400,
            "This server renders only its own chat template; a request's `chat_template` needs "
            "--trust-request-chat-template.",
            "chat_template",
        )


def render_prompt(
    ctx: ServingContext,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    chat_template: str | None,
    **flags: bool,
) -> str:
    """The prompt text (on a template thread): the template resolved and compiled, its kwargs checked, rendered in
    the bounded sandbox; every failure a 400."""
    param = "messages" if chat_template is None else "chat_template"
    try:
        template = (
            server_chat_template(ctx.tokenizer, tools)
            if chat_template is None
            else compile_chat_template(chat_template, timeout_s=ctx.config.server.chat_template_timeout_s)
        )
    except ValueError as exc:  # the model has no chat template
        raise APIError(400, str(exc), "messages") from None
    except jinja2.TemplateSyntaxError as exc:
        raise APIError(400, f"The chat template does not parse: {exc}", param) from None
    except RenderLimitError as exc:
        raise APIError(400, f"The chat template could not be compiled within its limits: {exc}.", param) from None
    special_tokens = ctx.tokenizer.special_tokens_map
    for key in template.refused_kwargs(template_kwargs, special_tokens):
        reads = ", ".join(sorted(template.variables)) or "none"
        why = (
            "is set by the server itself"
            if key in RENDERER_ARGS or key in special_tokens
            else f"is not a variable the chat template reads (it reads: {reads})"
        )
        raise APIError(400, f"chat_template_kwargs key {key!r} {why}.", f"chat_template_kwargs.{key}")
    try:
        return render_chat(
            ctx.tokenizer,
            messages,
            tools=tools,
            template_kwargs=template_kwargs,
            template=template,
            limits=RenderLimits.of(ctx.config.server),
            **flags,
        )
    except jinja2.exceptions.SecurityError as exc:
        raise APIError(400, f"The chat template tried something the sandbox forbids: {exc}", param) from None
    except RenderLimitError as exc:
        raise APIError(
            400, f"The chat template could not render this conversation within its limits: {exc}.", param
        ) from None
    except jinja2.TemplateError as exc:
        raise APIError(400, f"The chat template rejected the messages: {exc}", "messages") from None
    except ValueError as exc:  # continue_final_message without a final message to continue
        raise APIError(400, str(exc), "messages") from None
    except TEMPLATE_FAILURES as exc:
        raise APIError(400, f"The chat template failed on these messages: {type(exc).__name__}: {exc}", param) from None


async def create_chat_completion(ctx: ServingContext, http_request: web.Request) -> web.StreamResponse:
    received_at = time.monotonic()
    ctx.require_task("generate", http_request)
    request: ChatCompletionRequest = decode_request(await read_body(http_request), ChatCompletionRequest)
    target = ctx.resolve_model(request.model)
    logprobs = requested_chat_logprobs(request)
    refuse_unsupported(request)
    check_sampling_limits(request, ctx.config.server, logprobs=request.top_logprobs, logprobs_param="top_logprobs")
    plan = plan_tool_calling(request, ctx.config.server)
    prompt_ids = await chat_prompt_ids(
        ctx,
        request.messages,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        tools=request.tools,
        template_kwargs=request.chat_template_kwargs,
        chat_template=request.chat_template,
    )
    max_tokens = resolve_max_tokens(chat_max_tokens(request), len(prompt_ids), ctx.max_model_len)
    params = to_sampling_params(
        request,
        max_tokens=max_tokens,
        logprobs=logprobs,
        vocab_size=ctx.vocab_size,
        defaults=ctx.config.model.generation_defaults,
    )
    params.structured_outputs = await structured_outputs_params(ctx, request)
    plan = await apply_tool_plan(ctx, plan, params, prompt_ids)
    check_prompt_logprobs_budget([prompt_ids], [params], request.n, ctx.config.server)
    ctx.admission.check(ctx.engine, request.n)
    request_id = new_request_id("chatcmpl")
    choices = build_choices(
        ctx.tokenizer,
        request_id,
        [prompt_ids],
        [params],
        request.n,
        received_at=received_at,
        priority=request.priority,
        cache_salt=request.cache_salt,
        deadline=request_deadline(received_at, request.timeout, ctx.config.scheduler.request_timeout_s),
        lora_request=target.lora_request,
    )
    deltas = run_choices(ctx.engine, choices, ctx.metrics, ctx.admission)
    renderer = ChatRenderer(ctx, request, request_id, choices, plan)
    if request.stream:
        return await stream_deltas(
            http_request, deltas, renderer.chunk, preamble=renderer.role_chunks, epilogue=renderer.usage_chunk
        )
    summaries = [CompletionOutput(c.index) for c in choices]
    async with aclosing(deltas):
        async for delta in deltas:
            summaries[delta.index].add(delta)
    return web.Response(body=await renderer.full_response(summaries), content_type="application/json")


class ChatRenderer:
    """Builds the JSON of one chat response or of its stream chunks."""

    def __init__(
        self,
        ctx: ServingContext,
        request: ChatCompletionRequest,
        request_id: str,
        choices: list[Choice],
        plan: ToolPlan = ToolPlan(),
    ) -> None:
        self.ctx = ctx
        self.outputs = ChatOutputs(plan)  # reasoning and tool calls read from each choice's text
        self.request = request
        self.model_name = request.model or ctx.model_name  # the base, or the LoRA adapter it named
        self.request_id = request_id
        self.choices = choices
        self.created = now()
        self.texts = TokenTexts(ctx.tokenizer)
        self.num_top = request.top_logprobs or 0

    def _chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model_name, choices=choices)

    def _logprobs(self, token_ids: list[int], entries: list | None):
        if not self.request.logprobs or not entries:
            return None
        return chat_logprobs(token_ids, entries, self.texts, self.num_top)

    def role_chunks(self) -> list[bytes]:
        """The first chunk of every choice carries the role (and empty content), as OpenAI and vLLM send it."""
        return [
            encode_json(
                self._with_continuous_usage(
                    self._chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
                )
            )
            for c in self.choices
        ]

    def _with_continuous_usage(self, chunk: ChatCompletionChunk) -> ChatCompletionChunk:
        """The chunk with the usage so far when the request asked for it on every chunk (continuous_usage_stats)."""
        options = self.request.stream_options
        if options is not None and options.include_usage and options.continuous_usage_stats:
            chunk.usage = usage_info(self.choices)
        return chunk

    def chunk(self, delta: ChoiceDelta) -> bytes | None:
        logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        message, finish_reason = self.outputs.stream(delta)
        if is_empty(message) and delta.finish_reason is None and logprobs is None:
            return None
        chunk = self._chunk(
            [
                ChatStreamChoice(
                    index=delta.index,
                    delta=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=delta.stop_reason,
                )
            ]
        )
        return encode_json(self._with_continuous_usage(chunk))

    def usage_chunk(self) -> bytes | None:
        options = self.request.stream_options
        if options is None or not options.include_usage:
            return None
        chunk = self._chunk([])
        chunk.usage = usage_info(self.choices)
        return encode_json(chunk)

    async def full_response(self, summaries: list[CompletionOutput]) -> bytes:
        messages = [self.outputs.whole(s) for s in summaries]
        choices = [
            ChatChoice(
                index=s.index,
                message=message,
                logprobs=self._logprobs(s.token_ids, s.logprobs),
                finish_reason=reason,
                stop_reason=s.stop_reason,
            )
            for s, (message, reason) in zip(summaries, messages)
        ]
        return encode_json(
            ChatCompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.model_name,
                choices=choices,
                usage=usage_info(self.choices),
                prompt_logprobs=await response_prompt_logprobs(self.choices, summaries, self.texts),
            )
        )
