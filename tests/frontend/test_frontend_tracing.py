"""Request spans (`--otlp-traces-endpoint`) through the HTTP app against a fake engine, read back from the
OpenTelemetry SDK's in-memory exporter; and the JSON log lines (`--log-format json`) with the request id."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import aiohttp
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.helpers.frontend_fakes import FakeEngine
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.frontend.server import build_app
from tokenmill.frontend.tracing import MISSING_EXTRA, missing_tracing_extra
from tokenmill.logs import JsonFormatter, request_id_var

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


def traced_requests(model, tokenizer, bodies: list[tuple[str, dict, dict]]) -> list:
    """Send (path, body, headers) to an app whose tracer exports to memory; returns the finished spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = FakeEngine()
    engine.replies = [[11, 12, 13, 14]] * len(bodies)

    async def run() -> None:
        app = build_app(
            EngineConfig(model=model, server=ServerConfig()), engine, tokenizer, tracer=provider.get_tracer("test")
        )
        async with TestServer(app) as server, aiohttp.ClientSession() as http:
            for path, body, headers in bodies:
                async with http.post(server.make_url(path), json=body, headers=headers) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
            async with http.get(server.make_url("/v1/models")) as response:
                await response.read()  # not a generation: no span

    asyncio.run(run())
    return list(exporter.get_finished_spans())


def test_one_span_per_request_with_timings_tokens_finish_reason_and_the_callers_trace(smollm2_model, tokenizer):
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    spans = traced_requests(
        smollm2_model,
        tokenizer,
        [
            ("/v1/completions", {"prompt": "Hello world", "max_tokens": 4, "n": 2}, {"traceparent": traceparent}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True},
                {},
            ),
        ],
    )
    assert len(spans) == 2
    completion, chat = spans
    assert f"{completion.context.trace_id:032x}" == TRACE_ID  # the W3C traceparent became its parent
    assert f"{completion.parent.span_id:016x}" == PARENT_SPAN_ID
    assert chat.parent is None and f"{chat.context.trace_id:032x}" != TRACE_ID
    attrs = completion.attributes
    assert attrs["gen_ai.request.id"].startswith("cmpl-") and attrs["gen_ai.request.n"] == 2
    assert attrs["gen_ai.usage.completion_tokens"] == 8 and attrs["gen_ai.usage.prompt_tokens"] == 2
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["length", "length"]
    assert attrs["gen_ai.request.max_tokens"] == 4
    for name in ("time_in_queue", "time_to_first_token", "time_in_model_prefill", "time_in_model_decode", "e2e"):
        assert attrs[f"gen_ai.latency.{name}"] >= 0.0, name
    assert attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert completion.end_time >= completion.start_time
    assert chat.attributes["gen_ai.usage.completion_tokens"] == 3
    assert chat.attributes["gen_ai.request.id"].startswith("chatcmpl-")


def test_the_tracing_extra_is_found_here_and_its_absence_is_one_sentence():
    assert missing_tracing_extra() is None
    assert MISSING_EXTRA.count(".") == 0 and "pip install 'tokenmill[tracing]'" in MISSING_EXTRA


def test_json_log_lines_carry_the_request_id_of_their_context():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("frontend"))
    log = logging.getLogger("tokenmill.test_json_logs")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("outside any request")
        token = request_id_var.set("cmpl-123")
        log.warning("inside %s", "it")
        request_id_var.reset(token)
        log.warning("named explicitly", extra={"request_id": "chatcmpl-9"})
    finally:
        log.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line.get("request_id") for line in lines] == [None, "cmpl-123", "chatcmpl-9"]
    assert lines[1]["message"] == "inside it" and lines[1]["process"] == "frontend" and lines[1]["level"] == "WARNING"
