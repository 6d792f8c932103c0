"""/dashboard, /dashboard/stream and /debug/steps against a fake engine that sends StepSummary messages on demand."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import re

import aiohttp
from aiohttp.test_utils import TestServer

from tests.helpers.frontend_fakes import FakeEngine
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.frontend.dashboard import (
    CLIENT_BACKLOG,
    COOKIE_NAME,
    HUB_KEY,
    MAX_STREAMS,
    STREAM_INTERVAL_S,
    Subscriber,
    cookie_value,
)
from tokenmill.frontend.server import build_app
from tokenmill.messages import EngineReady, QueueEntry, StepSummary


def async_test(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return run


class WatchedEngine(FakeEngine):
    """The fake engine plus what the dashboard needs of AsyncEngineClient: `watch_steps` and `summary_listener`."""

    def __init__(self) -> None:
        super().__init__()
        self.summary_listener = None
        self.watch_calls: list[float] = []
        self.ready = None

    async def watch_steps(self, interval_s: float) -> None:
        self.watch_calls.append(interval_s)

    def send_summary(self, step_id: int, **changes) -> StepSummary:
        fields = dict(
            engine=0,
            step_id=step_id,
            time=1.7e9 + step_id,
            steps=[(step_id, 12, 3, 4, 0.02, 0)],
            num_running=1,
            num_waiting=1,
            queue=[
                QueueEntry("cmpl-a", True, 10, 12, 3, 16, 0, 0, 5),
                QueueEntry("cmpl-b", False, 0, 40, 0, 16, 2, 1, 0),
            ],
            num_blocks=8,
            block_size=16,
            num_free_blocks=6,
            num_cached_blocks=2,
            block_map=bytes([5, 5, 1, 1, 0, 0, 0, 0]),
            kv_cache_usage=0.25,
            prefix_cache_queries=100,
            prefix_cache_hits=25,
            num_preemptions=1,
            summary_time_s=0.001,
        )
        fields.update(changes)
        summary = StepSummary(**fields)
        self.summary_listener(summary)
        return summary


@contextlib.asynccontextmanager
async def serving(smollm2_model, tokenizer, **server_fields):
    engine = WatchedEngine()
    config = EngineConfig(model=smollm2_model, server=ServerConfig(**server_fields))
    app = build_app(config, engine, tokenizer)
    async with TestServer(app) as server:
        # unsafe: the jar keeps cookies from an IP address (the test server's 127.0.0.1) as a browser does
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            yield engine, server, http, app


async def next_event(resp: aiohttp.ClientResponse) -> tuple[str, str]:
    """(event name, data) of the next server-sent event, comments skipped."""
    name, data = "message", None
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), 10)).decode()
        assert line, "the stream ended"
        line = line.rstrip("\n")
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = line[len("data: ") :]
        elif line == "" and data is not None:
            return name, data


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


@async_test
async def test_the_page_is_one_self_contained_file(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as (engine, server, http, app):
        async with http.get(server.make_url("/dashboard")) as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
            html = await resp.text()
            csp = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert re.search(r"https?://", html) is None  # nothing is fetched from elsewhere
    assert re.search(r"<script[^>]+src=|<link[^>]+href=", html) is None  # no external script or style either
    assert 'new EventSource("/dashboard/stream")' in html


@async_test
async def test_the_stream_turns_summaries_on_and_off_and_carries_the_schema(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as (engine, server, http, app):
        assert engine.watch_calls == []  # nobody watches: the scheduler sends nothing
        async with http.get(server.make_url("/dashboard/stream")) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            await until(lambda: engine.watch_calls == [STREAM_INTERVAL_S])
            engine.send_summary(7)
            name, data = await next_event(resp)
            assert name == "message"
            update = json.loads(data)
            assert update["engine"] == 0 and update["step_id"] == 7 and update["model"] == "smollm2"
            assert update["steps"] == [
                {
                    "step_id": 7,
                    "prefill_tokens": 12,
                    "decode_tokens": 3,
                    "num_requests": 4,
                    "step_time_s": 0.02,
                    "preemptions": 0,
                }
            ]
            assert update["blocks"] == {
                "num_blocks": 8,
                "block_size": 16,
                "free": 4,
                "cached": 2,
                "used": 2,
                "kv_cache_usage": 0.25,
                "map": base64.b64encode(bytes([5, 5, 1, 1, 0, 0, 0, 0])).decode(),
            }
            assert update["prefix_cache"] == {"queries": 100, "hits": 25, "hit_rate": 0.25}
            assert update["queue"][1] == {
                "request_id": "cmpl-b",
                "status": "waiting",
                "prompt_computed": 0,
                "prompt_tokens": 40,
                "output_tokens": 0,
                "max_tokens": 16,
                "priority": 2,
                "preemptions": 1,
                "color": 0,
            }
            assert update["frontend"]["metrics"]["num_requests_running"] == 0.0
            assert set(update["frontend"]) >= {"time", "generation_tokens_per_s", "ttft_s", "tpot_s"}
            engine.send_summary(8, engine=1)  # a second engine's summaries come through the same stream
            assert json.loads((await next_event(resp))[1])["engine"] == 1
        await until(lambda: engine.watch_calls == [STREAM_INTERVAL_S, 0.0])  # the last one left: off again
        assert app[HUB_KEY].subscribers == set()


@async_test
async def test_debug_steps_is_json_lines_and_ends_after_limit(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as (engine, server, http, app):
        async with http.get(server.make_url("/debug/steps?limit=2")) as resp:
            assert resp.status == 200 and resp.content_type == "application/x-ndjson"
            await until(lambda: engine.watch_calls)
            for step_id in (1, 2, 3):
                engine.send_summary(step_id)
            body = await asyncio.wait_for(resp.read(), 10)  # ends by itself after two lines
        lines = body.decode().splitlines()
        assert [json.loads(line)["step_id"] for line in lines] == [1, 2]
        for bad in ("0", "-3", "x"):
            async with http.get(server.make_url(f"/debug/steps?limit={bad}")) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["param"] == "limit"


@async_test
async def test_api_key_bearer_token_and_cookie(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, api_key="s3cret") as (engine, server, http, app):
        for path in ("/dashboard", "/dashboard/stream", "/debug/steps", "/dashboard?token=wrong"):
            async with http.get(server.make_url(path)) as resp:
                assert resp.status == 401, path
                assert (await resp.json())["error"]["type"] == "AuthenticationError"
        async with http.get(server.make_url("/dashboard"), headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 200
        async with http.get(
            server.make_url("/debug/steps?limit=1"), headers={"Authorization": "Bearer s3cret"}
        ) as resp:
            assert resp.status == 200
            await until(lambda: engine.watch_calls)
            engine.send_summary(1)
            assert json.loads(await asyncio.wait_for(resp.read(), 10))["step_id"] == 1
        # ?token= swaps the key for an HttpOnly cookie and sends the browser to the bare URL
        async with http.get(server.make_url("/dashboard?token=s3cret"), allow_redirects=False) as resp:
            assert resp.status == 303 and resp.headers["Location"] == "/dashboard"
            set_cookie = resp.headers["Set-Cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie and "s3cret" not in set_cookie
        assert http.cookie_jar.filter_cookies(server.make_url("/"))[COOKIE_NAME].value == cookie_value("s3cret")
        async with http.get(server.make_url("/dashboard")) as resp:  # the cookie alone lets it in now
            assert resp.status == 200
        async with http.get(server.make_url("/dashboard/stream")) as resp:
            assert resp.status == 200
            engine.send_summary(2)
            assert json.loads((await next_event(resp))[1])["step_id"] == 2
        http.cookie_jar.clear()
        http.cookie_jar.update_cookies({COOKIE_NAME: cookie_value("another key")})
        async with http.get(server.make_url("/dashboard")) as resp:
            assert resp.status == 401


@async_test
async def test_disable_dashboard_leaves_the_routes_out(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, disable_dashboard=True) as (engine, server, http, app):
        for path in ("/dashboard", "/dashboard/stream", "/debug/steps"):
            async with http.get(server.make_url(path)) as resp:
                assert resp.status == 404, path
        assert engine.summary_listener is None  # nothing listens, nothing asks the scheduler for summaries


@async_test
async def test_streams_are_capped(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as (engine, server, http, app):
        responses = [await http.get(server.make_url("/debug/steps")) for _ in range(MAX_STREAMS)]
        try:
            assert all(r.status == 200 for r in responses)
            async with http.get(server.make_url("/dashboard/stream")) as resp:
                assert resp.status == 429 and "Retry-After" in resp.headers
        finally:
            for r in responses:
                r.close()
        await until(lambda: not app[HUB_KEY].subscribers)
        async with http.get(server.make_url("/debug/steps?limit=1")) as resp:  # room again
            assert resp.status == 200


@async_test
async def test_a_client_that_falls_behind_is_dropped_not_buffered(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as (engine, server, http, app):
        async with http.get(server.make_url("/dashboard/stream")) as resp:
            await until(lambda: engine.watch_calls)
            for step_id in range(CLIENT_BACKLOG + 5):  # all at once, before its handler can write any
                engine.send_summary(step_id)
            name, data = await next_event(resp)
            assert name == "dropped" and json.loads(data) == {"reason": "too slow"}
            assert await asyncio.wait_for(resp.content.read(), 10) == b""  # and the stream ends
        await until(lambda: not app[HUB_KEY].subscribers)


def test_the_subscriber_backlog_is_bounded():
    async def run():
        subscriber = Subscriber(backlog=3)
        for i in range(3):
            subscriber.offer(b"%d" % i)
        assert await subscriber.take(1) == [b"0", b"1", b"2"] and not subscriber.dropped
        for _ in range(4):
            subscriber.offer(b"x")
        assert subscriber.dropped and await subscriber.take(1) == [] and len(subscriber.updates) == 0
        subscriber.offer(b"y")  # a dropped subscriber takes nothing more
        assert len(subscriber.updates) == 0

    asyncio.run(run())


@async_test
async def test_metrics_show_the_cache_shape_as_vllm_does(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as (engine, server, http, app):
        engine.ready = EngineReady(
            num_kv_blocks=321,
            block_size=16,
            max_model_len=256,
            weight_bytes=1,
            device="cpu",
            dtype="float32",
            architecture="LlamaForCausalLM",
        )
        async with http.get(server.make_url("/metrics")) as resp:
            text = await resp.text()
    assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="321"} 1.0' in text
