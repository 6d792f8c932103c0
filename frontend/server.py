"""The aiohttp application: routes and middlewares (errors, API key (frontend/auth.py), CORS).

`build_app(config, engine, tokenizer)` wires the OpenAI endpoints to an engine client; `tokenmill/serve.py` serves
it. Handlers run with `handler_cancellation`, so a client that disconnects cancels its handler and its engine
requests are aborted.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tokenmill.config import EngineConfig
from tokenmill.frontend import serving_misc, serving_responses
from tokenmill.frontend.auth import make_auth_middleware
from tokenmill.frontend.context import ServingContext
from tokenmill.frontend.dashboard import add_dashboard_routes
from tokenmill.frontend.engine_protocol import EngineClient
from tokenmill.frontend.errors import APIError, error_response
from tokenmill.frontend.lifecycle import ServerLifecycle, make_lifecycle_middleware
from tokenmill.frontend.serving_chat import create_chat_completion
from tokenmill.frontend.serving_completions import create_completion
from tokenmill.frontend.serving_embeddings import EmbeddingServing
from tokenmill.frontend.serving_lora import add_lora_routes
from tokenmill.frontend.serving_score import add_score_routes
from tokenmill.frontend.tracing import RequestTracer, otlp_tracer

log = logging.getLogger("tokenmill.frontend")

CONTEXT_KEY = web.AppKey("serving_context", ServingContext)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error, ours or aiohttp's (404 route, 405, 413 body), as OpenAI's JSON error object."""
    try:
        return await handler(request)
    except APIError as error:
        return error_response(error.status, error.message, error.param, error.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            limit = request.app[CONTEXT_KEY].config.server.max_request_body_bytes
            message = f"The request body is too large (limit {limit} bytes)."
        elif exc.status == 404:
            message = f"No route {request.method} {request.path}."
        else:
            message = exc.reason
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        return error_response(exc.status, message, headers=headers)
    except Exception:
        log.exception("error while serving %s %s", request.method, request.path)
        return error_response(500, "Internal server error.")


def make_cors_middleware(allowed_origins: list[str]):
    """Answers preflight requests; the response-prepare hook adds the allow-origin header to every response."""

    @web.middleware
    async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            if allowed_origin(allowed_origins, request.headers.get("Origin")) is None:
                return error_response(403, "CORS origin not allowed.")
            return web.Response(
                status=200,
                headers={
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
                    "Access-Control-Max-Age": "600",
                },
            )
        return await handler(request)

    return cors_middleware


def allowed_origin(allowed_origins: list[str], origin: str | None) -> str | None:
    if origin is None:
        return None
    if "*" in allowed_origins:
        return "*"
    return origin if origin in allowed_origins else None


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    origins = request.app[CONTEXT_KEY].config.server.allowed_origins
    origin = allowed_origin(origins, request.headers.get("Origin"))
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        if origin != "*":
            response.headers["Vary"] = "Origin"


def build_app(
    config: EngineConfig,
    engine: EngineClient,
    tokenizer: Any,
    lifecycle: ServerLifecycle | None = None,
    tracer: Any = None,
) -> web.Application:
    """The HTTP app for one instance over `engine` (frontend/engine_protocol.py); `config.model` must be resolved
    (max_model_len, served_model_name, task). `lifecycle` gates the API while the engine loads, drains or restarts
    (None: an instance that serves at once). `tracer`: an OpenTelemetry tracer for the request spans (default: an
    OTLP exporter when --otlp-traces-endpoint is set)."""
    ctx = ServingContext.create(config, engine, tokenizer, lifecycle)
    middlewares = [error_middleware, make_auth_middleware(config.server), make_lifecycle_middleware(ctx.lifecycle)]
    if tracer is None and config.server.otlp_traces_endpoint:
        tracer = otlp_tracer(config.server.otlp_traces_endpoint)
    if tracer is not None:
        middlewares.append(RequestTracer(tracer, ctx.model_name).middleware())
    if config.server.allowed_origins:
        middlewares.insert(0, make_cors_middleware(config.server.allowed_origins))
    app = web.Application(
        middlewares=middlewares,
        client_max_size=config.server.max_request_body_bytes,
        handler_args={"handler_cancellation": True},
    )
    app[CONTEXT_KEY] = ctx
    app.on_cleanup.append(close_context)
    if config.server.allowed_origins:
        app.on_response_prepare.append(add_cors_headers)

    def route(handler: Callable[[ServingContext, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
        return functools.partial(handler, ctx)

    app.router.add_get("/v1/models", route(serving_misc.list_models))
    app.router.add_post("/v1/completions", route(create_completion))
    app.router.add_post("/v1/chat/completions", route(create_chat_completion))
    app.router.add_post("/v1/responses", route(serving_responses.create_response))
    for method, path in (
        ("GET", "/v1/responses/{response_id}"),
        ("DELETE", "/v1/responses/{response_id}"),
        ("POST", "/v1/responses/{response_id}/cancel"),
        ("GET", "/v1/responses/{response_id}/input_items"),
    ):
        app.router.add_route(method, path, route(serving_responses.response_not_stored))  # nothing is stored
    app.router.add_post("/tokenize", route(serving_misc.tokenize))
    app.router.add_post("/detokenize", route(serving_misc.detokenize))
    app.router.add_get("/health", route(serving_misc.health))
    app.router.add_get("/ready", route(serving_misc.ready))
    app.router.add_route("GET", "/ping", route(serving_misc.health))  # SageMaker's probe: GET and POST
    app.router.add_route("POST", "/ping", route(serving_misc.health))
    app.router.add_get("/load", route(serving_misc.load))
    app.router.add_get("/version", route(serving_misc.version))
    app.router.add_get("/metrics", route(serving_misc.metrics))
    if not config.server.disable_dashboard:  # /dashboard, /dashboard/stream, /debug/steps (behind --api-key)
        add_dashboard_routes(app, engine, ctx.metrics, ctx.model_name, config.server.api_key)
    if ctx.task == "embed":
        app.router.add_post("/v1/embeddings", EmbeddingServing(ctx).create_embedding)
    else:
        app.router.add_post("/v1/embeddings", route(wrong_task_embeddings))  # a clear 400: the wrong instance
    add_lora_routes(app, ctx)  # /v1/load_lora_adapter, /v1/unload_lora_adapter: only when runtime updating is on
    add_score_routes(app, ctx)  # /rerank, /score, /classify: a 400 naming the task on other instances
    return app


async def close_context(app: web.Application) -> None:
    app[CONTEXT_KEY].offload.close()


async def wrong_task_embeddings(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    ctx.require_task("embed", request)
    raise AssertionError("unreachable: only generation instances route here")
