"""`--otlp-traces-endpoint` and `--log-format json` against a real server: spans arrive over OTLP/HTTP at a collector
this test runs (decoded with OpenTelemetry's protobuf types), children of the caller's `traceparent`; every process
writes JSON lines, and the request's log lines carry its id."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from tests.helpers.server import Server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: every span it is sent lands in `spans`."""

    spans: ClassVar[list] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                Collector.spans.extend(scope_spans.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_request_span_reaches_the_collector_and_every_process_logs_json(tmp_path):
    collector = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    log_path = tmp_path / "server.log"
    try:
        with Server(
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            "32MiB",
            "--otlp-traces-endpoint",
            endpoint,
            "--log-format",
            "json",
            "--enable-log-requests",
            log_path=log_path,
            startup_timeout=600,
        ) as server:
            response = requests.post(
                f"{server.url}/v1/completions",
                timeout=300,
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"},
                json={"prompt": "The capital of France is", "max_tokens": 3},
            )
            assert response.status_code == 200
            request_id = response.json()["id"]
            deadline = time.monotonic() + 30  # the exporter sends in batches, every few seconds
            while not Collector.spans and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        collector.shutdown()
    [span] = Collector.spans
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    attributes = {a.key: a.value for a in span.attributes}
    assert attributes["gen_ai.request.id"].string_value == request_id
    assert attributes["gen_ai.usage.completion_tokens"].int_value == 3
    assert attributes["gen_ai.latency.time_to_first_token"].double_value > 0
    assert [v.string_value for v in attributes["gen_ai.response.finish_reasons"].array_value.values] == ["length"]

    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    # the scheduler sets up logging as the workers do (become_child_process) but has nothing to say on a good day
    assert {"frontend", "worker0"} <= {line["process"] for line in lines}
    request_lines = [line for line in lines if line.get("request_id") == request_id]
    assert request_lines and any("/v1/completions" in line["message"] for line in request_lines)
