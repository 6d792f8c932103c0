"""POST /v1/completions: prompts (text or token ids, one or many) in, `text_completion` JSON or SSE chunks out."""

from __future__ import annotations

import time
from contextlib import aclosing

from aiohttp import web

from tokenmill.frontend.context import ServingContext, new_request_id, read_body
from tokenmill.frontend.errors import APIError
from tokenmill.frontend.generation import Choice, build_choices, request_deadline, run_choices, usage_info
from tokenmill.frontend.limits import check_prompt_logprobs_budget, check_sampling_limits
from tokenmill.frontend.logprobs import TokenTexts, completion_logprobs
from tokenmill.frontend.outputs import ChoiceDelta, CompletionOutput
from tokenmill.frontend.prompt_logprobs import (
    echo_logprobs,
    engine_max_tokens,
    engine_prompt_logprobs,
    join_logprobs,
    prompt_logprobs_json,
)
from tokenmill.frontend.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    decode_request,
    encode_json,
    now,
    resolve_max_tokens,
    to_sampling_params,
)
from tokenmill.frontend.sse import stream_deltas
from tokenmill.frontend.structured_outputs import structured_outputs_params
from tokenmill.frontend.tokenizer import encode_texts
from tokenmill.frontend.unsupported import refuse_unsupported


async def prompt_inputs(ctx: ServingContext, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt: a string, a list of strings, token ids, or a list of token-id lists.
    Texts are tokenized on the tokenizer thread."""
    prompt = request.prompt
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        items = list(prompt)
    else:
        raise APIError(
            400,
            "prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists",
            "prompt",
        )
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(
        await ctx.offload.tokenize(encode_texts, ctx.tokenizer, texts, request.add_special_tokens) if texts else []
    )
    inputs: list[tuple[str | None, list[int]]] = []
    for item in items:
        if isinstance(item, str):
            inputs.append((item, next(encoded)))
        else:
            ctx.check_token_ids(item, "prompt")
            inputs.append((None, item))
        if not inputs[-1][1]:
            raise APIError(400, "prompt must not be empty", "prompt")
    return inputs


async def create_completion(ctx: ServingContext, http_request: web.Request) -> web.StreamResponse:
    received_at = time.monotonic()
    ctx.require_task("generate", http_request)
    request: CompletionRequest = decode_request(await read_body(http_request), CompletionRequest)
    target = ctx.resolve_model(request.model)
    refuse_unsupported(request)
    check_sampling_limits(request, ctx.config.server, logprobs=request.logprobs, logprobs_param="logprobs")
    max_tokens = engine_max_tokens(request)
    inputs = await prompt_inputs(ctx, request)
    params = [
        to_sampling_params(
            request,
            logprobs=request.logprobs,
            vocab_size=ctx.vocab_size,
            defaults=ctx.config.model.generation_defaults,
            max_tokens=resolve_max_tokens(max_tokens, len(ids), ctx.max_model_len, prompt_param="prompt"),
        )
        for _, ids in inputs
    ]
    structured_outputs = await structured_outputs_params(ctx, request)
    for prompt_params in params:
        prompt_params.structured_outputs = structured_outputs
        prompt_params.prompt_logprobs = engine_prompt_logprobs(request)
    check_prompt_logprobs_budget([ids for _, ids in inputs], params, request.n, ctx.config.server)
    ctx.admission.check(ctx.engine, len(inputs) * request.n)
    request_id = new_request_id("cmpl")
    choices = build_choices(
        ctx.tokenizer,
        request_id,
        [ids for _, ids in inputs],
        params,
        request.n,
        received_at=received_at,
        priority=request.priority,
        cache_salt=request.cache_salt,
        deadline=request_deadline(received_at, request.timeout, ctx.config.scheduler.request_timeout_s),
        lora_request=target.lora_request,
    )
    prompt_echoes = [await _echo_text(ctx, prompt) for prompt in inputs] if request.echo else [""] * len(inputs)
    echoes = [prompt_echoes[c.prompt_index] for c in choices]
    deltas = run_choices(ctx.engine, choices, ctx.metrics, ctx.admission)
    renderer = CompletionRenderer(ctx, request, request_id, choices, echoes)
    if request.stream:
        return await stream_deltas(http_request, deltas, renderer.chunk, epilogue=renderer.usage_chunk)
    summaries = [CompletionOutput(c.index) for c in choices]
    async with aclosing(deltas):
        async for delta in deltas:
            summaries[delta.index].add(delta)
    return web.Response(body=await renderer.full_response(summaries), content_type="application/json")


async def _echo_text(ctx: ServingContext, prompt: tuple[str | None, list[int]]) -> str:
    text, ids = prompt
    return (
        text if text is not None else await ctx.offload.tokenize(ctx.tokenizer.decode, ids, skip_special_tokens=False)
    )


class CompletionRenderer:
    """Builds the JSON of one completion response or of its stream chunks."""

    def __init__(
        self, ctx: ServingContext, request: CompletionRequest, request_id: str, choices: list[Choice], echoes: list[str]
    ) -> None:
        self.ctx = ctx
        self.request = request
        self.request_id = request_id
        self.choices = choices
        self.echoes = echoes
        self.model_name = request.model or ctx.model_name  # the base, or the LoRA adapter it named
        self.created = now()
        self.texts = TokenTexts(ctx.tokenizer)
        self.text_offsets = [len(echo) for echo in echoes]
        self.echo_sent = [not echo for echo in echoes]
        self.echo_only = request.echo and request.max_tokens == 0  # the prompt alone comes back (as vLLM)
        self.prompt_logprobs_sent = [False] * len(choices)

    def _logprobs(self, index: int, token_ids: list[int], entries: list | None, prompt_entries: list | None = None):
        """The choice's next completions logprobs: with echo, the prompt tokens' lead its first ones."""
        if self.request.logprobs is None:
            return None
        echoed = None
        if self.request.echo and not self.prompt_logprobs_sent[index]:
            self.prompt_logprobs_sent[index] = True
            echoed, self.text_offsets[index] = echo_logprobs(
                self.choices[index].request.prompt_token_ids, prompt_entries, self.request.logprobs, self.texts
            )
        if self.echo_only or not entries:
            return echoed
        logprobs, self.text_offsets[index] = completion_logprobs(
            token_ids, entries, self.texts, self.text_offsets[index]
        )
        return join_logprobs(echoed, logprobs)

    def chunk(self, delta: ChoiceDelta) -> bytes | None:
        text = "" if self.echo_only else delta.text
        if not self.echo_sent[delta.index]:
            text, self.echo_sent[delta.index] = self.echoes[delta.index] + text, True
        logprobs = self._logprobs(delta.index, delta.token_ids, delta.logprobs, delta.prompt_logprobs)
        keep_ids = self.request.return_token_ids and delta.token_ids
        if not text and delta.finish_reason is None and logprobs is None and not keep_ids:
            return None
        choice = CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        if self.request.return_token_ids:
            choice.token_ids = delta.token_ids
        response = CompletionResponse(id=self.request_id, created=self.created, model=self.model_name, choices=[choice])
        options = self.request.stream_options
        if options is not None and options.include_usage and options.continuous_usage_stats:
            response.usage = usage_info(self.choices)
        return encode_json(response)

    def usage_chunk(self) -> bytes | None:
        options = self.request.stream_options
        if options is None or not options.include_usage:
            return None
        return encode_json(
            CompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.model_name,
                choices=[],
                usage=usage_info(self.choices),
            )
        )

    async def full_response(self, summaries: list[CompletionOutput]) -> bytes:
        choices = [
            CompletionChoice(
                index=s.index,
                text=self.echoes[s.index] + ("" if self.echo_only else s.text),
                logprobs=self._logprobs(s.index, s.token_ids, s.logprobs, s.prompt_logprobs),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in summaries
        ]
        for choice, summary in zip(choices, summaries):
            if summary.prompt_logprobs is not None:  # as vLLM, whenever the engine computed them
                choice.prompt_logprobs = await prompt_logprobs_json(
                    self.choices[summary.index].request.prompt_token_ids, summary.prompt_logprobs, self.texts
                )
        if self.request.return_token_ids:
            for choice, summary in zip(choices, summaries):
                choice.token_ids = summary.token_ids
                choice.prompt_token_ids = self.choices[summary.index].request.prompt_token_ids
        return encode_json(
            CompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.model_name,
                choices=choices,
                usage=usage_info(self.choices),
            )
        )
