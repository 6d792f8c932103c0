"""bench_serving's client against a fake streaming OpenAI server with known timings."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from aiohttp import web
from bench_serving import Target, arrival_gaps, chunk_text, run_requests, summarize_run
from benchlib.workload import BenchRequest

FIRST_TOKEN_DELAY_S = 0.3
TOKEN_GAP_S = 0.1
TOKENS = 4
FAILING_MAX_TOKENS = 13


class FakeServer:
    """Streams TOKENS text chunks (the first after FIRST_TOKEN_DELAY_S, then every TOKEN_GAP_S), a finish chunk
    without text and a usage chunk; answers 500 when max_tokens is FAILING_MAX_TOKENS."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["max_tokens"] == FAILING_MAX_TOKENS:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)

            async def send(payload: dict) -> None:
                await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            if body["max_tokens"] == 1:  # one token whose text is empty (llama-server on a random-weight model)
                await send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
                await send({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
                await response.write(b"data: [DONE]\n\n")
                return response
            for i in range(TOKENS):
                if i:
                    await asyncio.sleep(TOKEN_GAP_S)
                await send({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
            await send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            await send({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": TOKENS}})
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.in_flight -= 1


async def serve_and_run(requests, max_concurrency):
    fake = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    target = Target(
        f"http://127.0.0.1:{port}/v1/completions",
        "fake",
        chat=False,
        token_id_prompts=True,
        ignore_eos=True,
        temperature=0.0,
    )
    try:
        results, duration = await run_requests(target, requests, float("inf"), 1.0, max_concurrency, 0, "test")
    finally:
        await runner.cleanup()
    return fake, results, duration


def test_client_times_chunks_counts_usage_and_reports_failures():
    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([4, 5], 4), BenchRequest([6], FAILING_MAX_TOKENS)]
    fake, results, duration = asyncio.run(serve_and_run(requests, max_concurrency=None))
    assert fake.bodies[0]["prompt"] == [1, 2, 3] and fake.bodies[0]["ignore_eos"] is True
    assert fake.bodies[0]["stream_options"] == {"include_usage": True}
    ok = [r for r in results if r.success]
    assert len(ok) == 2 and "HTTP 500" in results[2].error
    for result in ok:
        assert result.output_tokens == TOKENS
        assert FIRST_TOKEN_DELAY_S <= result.ttft_s < FIRST_TOKEN_DELAY_S + 1.0
        assert len(result.itl_s) == TOKENS - 1  # text chunks only: the finish and usage chunks carry no text
        assert all(gap >= TOKEN_GAP_S * 0.9 for gap in result.itl_s)
        assert result.tpot_s == pytest.approx((result.latency_s - result.ttft_s) / (TOKENS - 1))
    summary = summarize_run(results, duration)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["total_input_tokens"] == 5 and summary["total_output_tokens"] == 2 * TOKENS
    assert summary["output_throughput"] == pytest.approx(2 * TOKENS / duration)
    assert summary["itl_ms"]["count"] == 2 * (TOKENS - 1)
    assert summary["output_len_mismatches"] == 0
    assert summary["ttft_ms"]["mean"] >= FIRST_TOKEN_DELAY_S * 1e3


def test_max_concurrency_caps_requests_in_flight():
    requests = [BenchRequest([i + 1], 4) for i in range(5)]
    fake, results, _ = asyncio.run(serve_and_run(requests, max_concurrency=2))
    assert all(r.success for r in results)
    assert fake.max_in_flight == 2


def test_poisson_gaps_average_one_over_the_rate():
    gaps = arrival_gaps(20_000, request_rate=4.0, burstiness=1.0, seed=0)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: std equals mean
    bursty = arrival_gaps(20_000, request_rate=4.0, burstiness=0.25, seed=0)
    assert np.mean(bursty) == pytest.approx(0.25, rel=0.05) and np.std(bursty) > 1.5 * np.std(gaps)
    assert not arrival_gaps(3, float("inf"), 1.0, 0).any()


def test_chunk_text_reads_completions_and_chat_chunks():
    assert chunk_text({"choices": [{"text": "hi"}]}, chat=False) == "hi"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, chat=True) == ""
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}, chat=True) == "yo"
    assert chunk_text({"choices": [], "usage": {}}, chat=False) == ""


def test_a_first_token_with_empty_text_still_times_the_ttft():
    _, results, _ = asyncio.run(serve_and_run([BenchRequest([1], 1)], max_concurrency=None))
    assert results[0].success and results[0].output_tokens == 1
    assert FIRST_TOKEN_DELAY_S <= results[0].ttft_s < FIRST_TOKEN_DELAY_S + 1.0
