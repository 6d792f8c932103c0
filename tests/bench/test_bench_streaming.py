"""benchlib.streaming: chunk timing against a fake SSE server, and the split of token gaps around a window."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from benchlib.launch import free_port
from benchlib.streaming import (
    StreamTiming,
    completion_payload,
    http_session,
    served_model_name,
    split_gaps_at_window,
    stream_completion,
)

FIRST_DELAY_S = 0.3
GAP_S = 0.2


async def fake_completions(request: web.Request) -> web.StreamResponse:
    """Two token chunks (the second with two tokens) around a text-only chunk, a finish chunk, a usage chunk."""
    body = await request.json()
    if body["model"] != "fake":
        return web.json_response({"error": {"message": "no such model"}}, status=404)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)

    async def send(payload: dict, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    await send({"choices": [{"index": 0, "text": "a", "token_ids": [11]}]}, FIRST_DELAY_S)
    await send({"choices": [{"index": 0, "text": "held back", "token_ids": []}]})
    await send({"choices": [{"index": 0, "text": "bc", "token_ids": [12, 13]}]}, GAP_S)
    await send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    await send(
        {
            "choices": [],
            "usage": {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}},
        }
    )
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def with_fake_server(client) -> object:
    app = web.Application()
    app.router.add_post("/v1/completions", fake_completions)
    app.router.add_get("/v1/models", lambda _: web.json_response({"data": [{"id": "fake"}]}))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with http_session() as session:
            return await client(session, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def test_stream_completion_times_token_chunks_and_reads_usage():
    async def client(session, url):
        model = await served_model_name(session, url)
        return await stream_completion(session, url, completion_payload(model, [1, 2, 3], 3), "probe")

    timing = asyncio.run(with_fake_server(client))
    assert timing.error is None
    assert timing.chunk_num_tokens == [1, 2]  # the text-only and the finish chunk carry no tokens
    assert timing.num_tokens == 3
    assert timing.finish_reason == "length"
    assert timing.num_cached_tokens == 32
    assert FIRST_DELAY_S <= timing.ttft < FIRST_DELAY_S + 1.0
    [(start, end)] = timing.itl_intervals()
    assert GAP_S <= end - start < GAP_S + 1.0


def test_stream_completion_reports_http_errors():
    async def client(session, url):
        return await stream_completion(session, url, completion_payload("other", [1], 1), "bad model")

    timing = asyncio.run(with_fake_server(client))
    assert timing.error is not None and timing.error.startswith("HTTP 404")
    assert timing.chunk_times == [] and timing.ttft is None


def test_completion_payload_ignores_eos_and_passes_extras():
    payload = completion_payload("m", [5, 6], 7, priority=-1)
    assert payload["prompt"] == [5, 6] and payload["max_tokens"] == 7 and payload["priority"] == -1
    assert payload["ignore_eos"] and payload["stream"] and payload["return_token_ids"]


def test_split_gaps_at_window_keeps_overlapping_gaps_and_the_baseline_before():
    a = StreamTiming("a", 0.0, chunk_times=[1.0, 2.0, 3.0, 10.0, 11.0, 20.0])
    b = StreamTiming("b", 0.0, chunk_times=[1.5, 2.5])
    inside, before = split_gaps_at_window([a, b], start=2.5, end=10.5)
    # a: 2->3 overlaps, 3->10 inside, 10->11 overlaps the end; 11->20 is after; b: 1.5->2.5 ends at the start
    assert sorted(inside) == pytest.approx([1.0, 1.0, 7.0])
    assert sorted(before) == pytest.approx([1.0, 1.0])
