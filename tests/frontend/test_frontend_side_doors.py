"""Every side door behind `--api-key` (only /health and /ping open), /health without addresses, the access log
without query strings, the dashboard cookie's lifetime and TLS flag, and the side endpoints' own bounded thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer, make_mocked_request

from tests.helpers.frontend_fakes import FakeEngine
from tests.helpers.frontend_server import async_test
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.frontend.dashboard import COOKIE_NAME
from tokenmill.frontend.errors import APIError
from tokenmill.frontend.offload import Offload
from tokenmill.frontend.redaction import RedactingAccessLogger, without_addresses
from tokenmill.frontend.server import CONTEXT_KEY, build_app

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
KEYED = [
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/models", None),
    ("GET", "/debug/steps?limit=1", None),
    ("GET", "/dashboard", None),
    ("GET", "/load", None),
]


@contextlib.asynccontextmanager
async def serving(model, tokenizer, engine: FakeEngine | None = None, **server_fields):
    config = EngineConfig(model=model, server=ServerConfig(**server_fields))
    server = TestServer(build_app(config, engine or FakeEngine(), tokenizer))
    await server.start_server(access_log_class=RedactingAccessLogger)  # as tokenmill/serve.py runs the app
    async with server, aiohttp.ClientSession() as http:
        yield server, http


async def status_of(
    http: aiohttp.ClientSession, server: TestServer, method: str, path: str, body=None, headers=None
) -> int:
    async with http.request(method, server.make_url(path), json=body, headers=headers) as resp:
        if resp.content_type == "application/x-ndjson":
            return resp.status  # an endless stream: the status is all we need
        await resp.read()
        return resp.status


@async_test
async def test_only_health_ready_and_ping_are_open(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, api_key=KEY) as (server, http):
        for method, path, body in KEYED:
            assert await status_of(http, server, method, path, body) == 401, path
            assert await status_of(http, server, method, path, body, {"Authorization": "Bearer nope"}) == 401, path
            assert await status_of(http, server, method, path, body, AUTH) == 200, path
        for method, path in (("GET", "/health"), ("GET", "/ready"), ("GET", "/ping"), ("POST", "/ping")):
            assert await status_of(http, server, method, path) == 200, path


@async_test
async def test_disable_metrics_auth_opens_metrics_only(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, api_key=KEY, disable_metrics_auth=True) as (server, http):
        assert await status_of(http, server, "GET", "/metrics") == 200
        assert await status_of(http, server, "POST", "/tokenize", {"prompt": "hi"}) == 401
        assert await status_of(http, server, "GET", "/version") == 401


@async_test
async def test_ping_is_503_when_the_engine_is_gone(smollm2_model, tokenizer):
    engine = FakeEngine()
    async with serving(smollm2_model, tokenizer, engine) as (server, http):
        engine.dead_reason = "worker3 died"
        for method in ("GET", "POST"):
            assert await status_of(http, server, method, "/ping") == 503


@async_test
async def test_health_names_no_address(smollm2_model, tokenizer):
    engine = FakeEngine()
    engine.dead_reason = (
        "tokenmill-worker1 (Ray actor on 10.1.2.3) ended: RayActorError: lost tcp://10.1.2.3:41234 "
        "and [fe80::1]:8000, gcs at 2001:db8::7 (pid 4242)"
    )
    async with (
        serving(smollm2_model, tokenizer, engine) as (server, http),
        http.get(server.make_url("/health")) as resp,
    ):
        assert resp.status == 503
        message = (await resp.json())["error"]["message"]
    assert "tokenmill-worker1" in message and "RayActorError" in message and "pid 4242" in message
    for leak in ("10.1.2.3", "41234", "fe80", "2001:db8", "8000"):
        assert leak not in message, message


def test_without_addresses_keeps_plain_text():
    text = "worker 2 exited with code 1 at step 12: CUDA error 700 (pid 31337)"
    assert without_addresses(text) == text
    assert without_addresses("node 192.168.0.10:6379 gone") == "node <address> gone"


@async_test
async def test_access_log_has_no_query_string(smollm2_model, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    async with serving(smollm2_model, tokenizer, api_key=KEY) as (server, http):
        async with http.get(
            server.make_url(f"/dashboard?token={KEY}"),
            allow_redirects=False,
            headers={"Referer": f"http://example/dashboard?token={KEY}"},
        ) as resp:
            assert resp.status == 303
        await asyncio.sleep(0.05)  # the line is written after the response
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert any("GET /dashboard " in line and " 303 " in line for line in lines), lines
    assert not any(KEY in line for line in lines), lines


@pytest.mark.parametrize("tls", [False, True])
@async_test
async def test_dashboard_cookie_expires_and_is_secure_over_tls(smollm2_model, tokenizer, tls):
    config = EngineConfig(model=smollm2_model, server=ServerConfig(api_key=KEY))
    app = build_app(config, FakeEngine(), tokenizer)
    request = make_mocked_request(
        "GET", f"/dashboard?token={KEY}", app=app, sslcontext=ssl.create_default_context() if tls else None
    )
    match = await app.router.resolve(request)
    response = await match.handler(request)
    cookie = response.cookies[COOKIE_NAME].OutputString()
    assert response.status == 303 and "Max-Age=" in cookie and "SameSite=Strict" in cookie and "HttpOnly" in cookie
    assert ("Secure" in cookie) == tls


@async_test
async def test_side_endpoints_queue_is_bounded_and_leaves_the_tokenizer_thread_free():
    offload = Offload(side_queue_limit=3)
    release = threading.Event()
    try:
        blocked = [asyncio.ensure_future(offload.side(release.wait)) for _ in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as info:
            await offload.side(time.time)
        assert info.value.status == 429 and "Retry-After" in info.value.headers
        # the /v1 threads answer at once while the side thread is stuck
        assert await asyncio.wait_for(offload.tokenize(lambda: "tok"), 2) == "tok"
        assert await asyncio.wait_for(offload.render(lambda: "tpl"), 2) == "tpl"
        blocked[2].cancel()  # a caller that went away before its job started frees its place
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(offload.side(lambda: "side"))
        release.set()
        assert await asyncio.wait_for(queued, 2) == "side"
        await asyncio.gather(*blocked[:2])
    finally:
        release.set()
        offload.close()


@async_test
async def test_side_endpoints_use_their_own_tokenizer(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as (server, http):
        ctx = server.app[CONTEXT_KEY]
        async with http.post(server.make_url("/tokenize"), json={"prompt": "Hello world"}) as resp:
            tokens = (await resp.json())["tokens"]
        assert tokens == tokenizer("Hello world")["input_ids"]
        side = await ctx.offload.side_tokenizer(tokenizer)
        assert side is not tokenizer and side("Hello world")["input_ids"] == tokens
        async with http.post(server.make_url("/detokenize"), json={"tokens": tokens}) as resp:
            assert (await resp.json())["prompt"] == "Hello world"
