"""OpenTelemetry traces (`--otlp-traces-endpoint`): one span per generation request, with vLLM's attribute names.

The middleware opens a `RequestTrace` for each POST to a generation endpoint and makes it current (a context
variable, which the choices' tasks inherit); `frontend/generation.py` records into it as outputs arrive (first token,
finish reasons, the scheduler's queue time); when the handler returns (after the last SSE chunk of a stream) the span
is emitted, with its start at the request's arrival and its parent taken from the W3C `traceparent` header.

OpenTelemetry is an optional extra (`pip install 'tokenmill[tracing]'`), imported only when the flag is set; without
it nothing is recorded and no per-request work is done.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
MISSING_EXTRA = "--otlp-traces-endpoint needs OpenTelemetry, which is not installed: pip install 'tokenmill[tracing]'"


@dataclass
class RequestTrace:
    """What one request's span reports, recorded while it runs (monotonic times)."""

    received_at: float
    sent_at: float = 0.0  # handed to the engine (after validation, templating, tokenizing)
    first_token_at: float = 0.0
    queue_time_s: float = 0.0  # the longest any of its choices waited in the scheduler's queue
    finish_reasons: list[str] = field(default_factory=list)
    choices: list[Any] = field(default_factory=list)  # generation.Choice: their token counts at the end
    params: Any = None  # the first choice's SamplingParams

    def engine_started(self, choices: list[Any]) -> None:
        self.sent_at = time.monotonic()
        self.choices = list(choices)
        self.params = choices[0].request.sampling if choices else None

    def first_token(self, now: float) -> None:
        if not self.first_token_at:
            self.first_token_at = now

    def choice_finished(self, finish_reason: str, queue_time_s: float) -> None:
        self.finish_reasons.append(finish_reason)
        self.queue_time_s = max(self.queue_time_s, queue_time_s)


current_trace: ContextVar[RequestTrace | None] = ContextVar("tokenmill_request_trace", default=None)


def span_attributes(trace: RequestTrace, request_id: str | None, model: str, end: float) -> dict[str, Any]:
    """The span's attributes, under vLLM's names (gen_ai.*); latencies in seconds."""
    prompt_tokens: dict[int, int] = {}
    for choice in trace.choices:
        prompt_tokens[choice.prompt_index] = len(choice.request.prompt_token_ids)
    attributes: dict[str, Any] = {
        "gen_ai.response.model": model,
        "gen_ai.usage.prompt_tokens": sum(prompt_tokens.values()),
        "gen_ai.usage.completion_tokens": sum(c.num_generated_tokens for c in trace.choices),
        "gen_ai.response.finish_reasons": list(trace.finish_reasons),
        "gen_ai.latency.time_in_queue": trace.queue_time_s,
        "gen_ai.latency.e2e": end - trace.received_at,
    }
    if request_id is not None:
        attributes["gen_ai.request.id"] = request_id
    if trace.params is not None:
        attributes.update(
            {
                "gen_ai.request.n": len(trace.choices),
                "gen_ai.request.temperature": trace.params.temperature,
                "gen_ai.request.top_p": trace.params.top_p,
            }
        )
        if trace.params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = trace.params.max_tokens
    if trace.first_token_at:
        attributes["gen_ai.latency.time_to_first_token"] = trace.first_token_at - trace.received_at
        # from the engine's start on it to its first token, less the wait for a place in the batch
        attributes["gen_ai.latency.time_in_model_prefill"] = max(
            trace.first_token_at - trace.sent_at - trace.queue_time_s, 0.0
        )
        attributes["gen_ai.latency.time_in_model_decode"] = end - trace.first_token_at
    return attributes


class RequestTracer:
    """Emits the spans; `tracer` is an OpenTelemetry Tracer (tests pass one over the SDK's in-memory exporter)."""

    def __init__(self, tracer: Any, model: str) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.model = model
        self.propagator = TraceContextTextMapPropagator()

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def tracing_middleware(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            if request.method != "POST" or request.path not in TRACED_PATHS:
                return await handler(request)
            trace = RequestTrace(received_at=time.monotonic())
            start_ns = time.time_ns()
            token = current_trace.set(trace)
            try:
                return await handler(request)
            finally:
                current_trace.reset(token)
                self.emit(trace, request, start_ns)

        return tracing_middleware

    def emit(self, trace: RequestTrace, request: web.Request, start_ns: int) -> None:
        from opentelemetry.trace import SpanKind

        from tokenmill.logs import request_id_var

        parent = self.propagator.extract(carrier=dict(request.headers))
        end = time.monotonic()
        span = self.tracer.start_span(
            f"llm_request {request.path}", context=parent, kind=SpanKind.SERVER, start_time=start_ns
        )
        span.set_attributes(span_attributes(trace, request_id_var.get(), self.model, end))
        span.end(end_time=start_ns + int((end - trace.received_at) * 1e9))


def missing_tracing_extra() -> str | None:
    """Why --otlp-traces-endpoint cannot work here (one sentence), or None when the extra is installed."""
    import importlib.util

    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            if importlib.util.find_spec(module) is None:
                return MISSING_EXTRA
        except ModuleNotFoundError:
            return MISSING_EXTRA
    return None


def otlp_tracer(endpoint: str, service_name: str = "tokenmill") -> Any:
    """A tracer exporting over OTLP/HTTP to `endpoint`, in batches off the event loop. Raises RuntimeError with one
    sentence when the `tracing` extra is not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise RuntimeError(MISSING_EXTRA) from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer("tokenmill")
