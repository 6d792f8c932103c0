"""The small endpoints: /v1/models, /tokenize, /detokenize, /health, /ready, /ping, /load, /version, /metrics.

/health (and SageMaker's /ping) is liveness: 200 while the engine processes are alive and the scheduler answers a
heartbeat on its loop. /ready is readiness: 200 `{"status": "ready"}` only while the instance admits requests and the
heartbeat answers; else 503 with the phase ("loading", "draining", "degraded"), so a load balancer sends nothing here.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

import tokenmill
from tokenmill.frontend.context import ServingContext, read_body
from tokenmill.frontend.errors import APIError, error_response
from tokenmill.frontend.limits import check_json_depth
from tokenmill.frontend.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    decode_request,
    encode_json,
)
from tokenmill.frontend.redaction import without_addresses
from tokenmill.frontend.serving_chat import check_request_template_allowed, message_dicts, render_prompt
from tokenmill.frontend.tokenizer import encode_text


def json_response(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")


async def list_models(ctx: ServingContext, request: web.Request) -> web.Response:
    card = ModelCard(
        id=ctx.model_name,
        created=ctx.created,
        root=ctx.config.model.path or ctx.model_name,
        max_model_len=ctx.max_model_len,
    )
    adapters = [
        ModelCard(
            id=name,
            created=ctx.created,
            root=adapter.request.lora_path,
            parent=adapter.parent,
            max_model_len=ctx.max_model_len,
        )
        for name, adapter in ctx.lora.adapters.items()
    ]
    return json_response(encode_json(ModelList(data=[card, *adapters])))


async def tokenize(ctx: ServingContext, request: web.Request) -> web.Response:
    body: TokenizeRequest = decode_request(await read_body(request), TokenizeRequest)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of `prompt` and `messages`", "prompt")
    if body.messages is not None:
        if body.add_special_tokens:
            raise APIError(
                400,
                "add_special_tokens applies to a prompt; the chat template adds them for messages",
                "add_special_tokens",
            )
        check_json_depth(body, ctx.config.server.max_json_depth)
        ids = await side_chat_prompt_ids(ctx, body)
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await ctx.offload.side(
            encode_text, await ctx.offload.side_tokenizer(ctx.tokenizer), body.prompt or "", add_special
        )
    response = TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)
    if body.return_token_strs:
        tokenizer = await ctx.offload.side_tokenizer(ctx.tokenizer)
        response.token_strs = list(await ctx.offload.side(tokenizer.convert_ids_to_tokens, ids))
    return json_response(encode_json(response))


async def side_chat_prompt_ids(ctx: ServingContext, body: TokenizeRequest) -> list[int]:
    """`chat_prompt_ids` on the side endpoints' thread (frontend/offload.py), rendering and tokenizing alike."""
    check_request_template_allowed(ctx, body.chat_template)
    assert body.messages is not None
    text = await ctx.offload.side(
        render_prompt,
        ctx,
        message_dicts(body.messages),
        body.tools,
        body.chat_template_kwargs or {},
        body.chat_template,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    return await ctx.offload.side(encode_text, await ctx.offload.side_tokenizer(ctx.tokenizer), text, False)


async def detokenize(ctx: ServingContext, request: web.Request) -> web.Response:
    body: DetokenizeRequest = decode_request(await read_body(request), DetokenizeRequest)
    ctx.check_model(body.model)
    ctx.check_token_ids(body.tokens, "tokens")
    tokenizer = await ctx.offload.side_tokenizer(ctx.tokenizer)
    text = await ctx.offload.side(
        tokenizer.decode, body.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return json_response(encode_json(DetokenizeResponse(prompt=text)))


async def health(ctx: ServingContext, request: web.Request) -> web.Response:
    """/health and /ping (GET and POST, SageMaker's probe): 200 while serving, 503 with the reason once the engine is
    gone. Open without the API key, so what it says names no address (frontend/redaction.py)."""
    if await ctx.engine.check_health():
        # data parallel with a replica down: still serving, and saying which replica is gone
        detail = ctx.engine.health_detail()
        if detail is None:
            return web.Response(status=200)
        return json_response(without_addresses(encode_json(detail).decode()).encode())
    reason = ctx.engine.dead_reason
    return error_response(
        503, f"The engine stopped: {without_addresses(reason)}." if reason else "The engine is not ready."
    )


async def ready(ctx: ServingContext, request: web.Request) -> web.Response:
    phase = ctx.lifecycle.phase
    if phase == "ready" and not await ctx.engine.check_health():
        phase = "degraded"  # admitted, but the engine does not answer its heartbeat (dead, hung or restarting)
    return web.Response(
        status=200 if phase == "ready" else 503, body=encode_json({"status": phase}), content_type="application/json"
    )


async def load(ctx: ServingContext, request: web.Request) -> web.Response:
    """vLLM's `server_load` (API requests in flight) and the scheduler's latest queues and KV cache usage."""
    stats = ctx.engine.latest_stats
    return json_response(
        encode_json(
            {
                "server_load": ctx.lifecycle.in_flight,
                "num_running": stats.num_running if stats is not None else 0,
                "num_waiting": stats.num_waiting if stats is not None else 0,
                "kv_cache_usage": stats.kv_cache_usage if stats is not None else 0.0,
            }
        )
    )


async def version(ctx: ServingContext, request: web.Request) -> web.Response:
    return json_response(encode_json({"version": tokenmill.__version__}))


async def metrics(ctx: ServingContext, request: web.Request) -> web.Response:
    response = web.Response(body=ctx.metrics.render())
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response
