"""The HTTP frontend served over a fake engine (aiohttp's test server), and the checks its tests share."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass

import aiohttp
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI

from tests.helpers.frontend_fakes import FakeEngine
from tokenmill.config import EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig, ServerConfig
from tokenmill.frontend.server import build_app

MODEL = "smollm2"


def async_test(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return run


@dataclass
class Harness:
    server: TestServer
    client: AsyncOpenAI
    http: aiohttp.ClientSession
    engine: FakeEngine

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def post(self, path: str, body=None, data: bytes | None = None, headers=None):
        async with self.http.post(self.url(path), json=body, data=data, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers

    async def good_completion(self) -> None:
        """The server still answers a valid request."""
        resp = await self.client.completions.create(model=MODEL, prompt="Hello world", max_tokens=2)
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 2


@contextlib.asynccontextmanager
async def serving(
    model: ModelConfig,
    tokenizer,
    engine: FakeEngine | None = None,
    api_key: str | None = None,
    max_waiting: int = 4096,
    lora: LoRAConfig | None = None,
    **server_fields,
):
    engine = engine or FakeEngine()
    config = EngineConfig(
        model=model,
        server=ServerConfig(api_key=api_key, **server_fields),
        scheduler=SchedulerConfig(max_waiting_requests=max_waiting),
        lora=lora or LoRAConfig(),
    )
    async with TestServer(build_app(config, engine, tokenizer)) as server:
        client = AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=api_key or "unused", max_retries=0)
        async with aiohttp.ClientSession() as http:
            yield Harness(server, client, http, engine)
        await client.close()


def assert_error(status: int, body: dict, expected_status: int, expected_type: str, param: str | None = None):
    assert status == expected_status, body
    error = body["error"]
    assert error["code"] == expected_status and error["type"] == expected_type and error["message"]
    if param is not None:
        assert error["param"] == param
