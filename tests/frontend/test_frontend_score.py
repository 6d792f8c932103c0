"""/rerank, /score and /classify over a fake engine: request and response shapes (vLLM's, Cohere's and Jina's),
ordering, text-pair tokens, bounds (400 naming the field), and each endpoint refused by an instance of another task
with a 400 naming that task."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.helpers.cross_encoders import build_bert_cross_encoder
from tests.helpers.frontend_fakes import FakeEngine
from tests.helpers.frontend_server import assert_error, async_test, serving
from tokenmill.config import ModelConfig
from tokenmill.frontend.serving_score import MAX_TEXT_CHARS, MAX_TEXTS
from tokenmill.frontend.tokenizer import load_tokenizer
from tokenmill.messages import EngineRequest, RequestOutput

MODEL = "reranker"
DOCUMENTS = ["paged attention keeps KV in blocks", "the cat sat on the mat", "blocks", "a prefix cache shares blocks"]


def fake_score(token_ids: list[int]) -> float:
    """A score in (0, 1) that differs for every token-id list."""
    return float(np.sin(sum((i + 1) * t for i, t in enumerate(token_ids)) % 997) * 0.49 + 0.5)


class FakeScoringEngine(FakeEngine):
    """Answers each request with one float32 per label, out of input order."""

    num_labels = 1

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        await asyncio.sleep(0.001 * (len(self.requests) % 3))
        score = fake_score(request.prompt_token_ids)
        values = np.array([score] * self.num_labels if self.num_labels == 1 else [score, 1 - score, 0.0], np.float32)
        yield RequestOutput(
            request.request_id, [], "stop", num_prompt_tokens=len(request.prompt_token_ids), embedding=values.tobytes()
        )


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> ModelConfig:
    path = str(build_bert_cross_encoder(tmp_path_factory.mktemp("ce")))
    return ModelConfig(model=path, path=path, served_model_name=MODEL, max_model_len=512, task="score")


@contextlib.asynccontextmanager
async def reranking(model: ModelConfig, engine: FakeEngine | None = None):
    async with serving(model, load_tokenizer(model), engine or FakeScoringEngine()) as harness:
        yield harness


@async_test
async def test_rerank_sorted_with_documents_in_every_spelling(reranker):
    tokenizer = AutoTokenizer.from_pretrained(reranker.path)
    pair_ids = [tokenizer("q?", text_pair=doc)["input_ids"] for doc in DOCUMENTS]
    want = [fake_score(ids) for ids in pair_ids]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    async with reranking(reranker) as h:
        documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2], {"text": DOCUMENTS[3]}]  # Jina and Cohere
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            status, body, _ = await h.post(path, {"model": MODEL, "query": "q?", "documents": documents, "top_n": 3})
            assert status == 200, body
            assert body["model"] == MODEL and body["id"].startswith("rerank-")
            assert [r["index"] for r in body["results"]] == order[:3]
            assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order[:3]]
            np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], sorted(want)[::-1][:3], 1e-6)
            assert body["usage"]["total_tokens"] == sum(len(ids) for ids in pair_ids)
        status, body, _ = await h.post("/rerank", {"query": "q?", "documents": DOCUMENTS, "return_documents": False})
        assert status == 200 and len(body["results"]) == 4 and all("document" not in r for r in body["results"])
        # BERT pairs carry their token types: the second segment starts after the query's [SEP]
        assert h.engine.requests[-1].second_segment_start == tokenizer("q?")["input_ids"].__len__()
        assert all(r.task == "score" for r in h.engine.requests)


@async_test
async def test_score_one_to_many_and_pairwise(reranker):
    tokenizer = AutoTokenizer.from_pretrained(reranker.path)
    async with reranking(reranker) as h:
        status, body, _ = await h.post("/score", {"text_1": "q", "text_2": DOCUMENTS})
        assert status == 200, body
        want = [fake_score(tokenizer("q", text_pair=doc)["input_ids"]) for doc in DOCUMENTS]
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["data"][0]["object"] == "score"
        np.testing.assert_allclose([d["score"] for d in body["data"]], want, 1e-6)
        status, body, _ = await h.post("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d"]})
        want = [fake_score(tokenizer(x, text_pair=y)["input_ids"]) for x, y in (("a", "c"), ("b", "d"))]
        assert status == 200 and body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        np.testing.assert_allclose([d["score"] for d in body["data"]], want, 1e-6)
        status, body, _ = await h.post("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
        assert_error(status, body, 400, "BadRequestError", "text_1")


@async_test
async def test_classify_labels_from_id2label(tmp_path):
    path = str(build_bert_cross_encoder(tmp_path, num_labels=3))
    model = ModelConfig(model=path, path=path, served_model_name=MODEL, max_model_len=512, task="classify")
    engine = FakeScoringEngine()
    engine.num_labels = 3
    async with reranking(model, engine) as h:
        status, body, _ = await h.post("/v1/classify", {"input": ["good", "bad"]})
        assert status == 200, body
        for item in body["data"]:
            assert item["num_classes"] == 3 and len(item["probs"]) == 3
            assert item["label"] == ["negative", "neutral", "positive"][int(np.argmax(item["probs"]))]
        assert all(r.task == "classify" and r.second_segment_start is None for r in engine.requests)
        status, body, _ = await h.post("/rerank", {"query": "q", "documents": ["d"]})
        assert_error(status, body, 400, "BadRequestError")
        assert "3 labels" in body["error"]["message"]


@async_test
async def test_bounds_are_400_naming_the_field_and_disturb_nothing(reranker):
    async with reranking(reranker) as h:
        cases = [
            ("/rerank", {"query": "q", "documents": []}, "documents"),
            ("/rerank", {"query": "q", "documents": ["d"] * (MAX_TEXTS + 1)}, "documents"),
            ("/rerank", {"query": "q" * (MAX_TEXT_CHARS + 1), "documents": ["d"]}, "query"),
            ("/rerank", {"query": "q", "documents": ["word " * 600]}, "documents"),  # over max_model_len
            ("/rerank", {"query": "q", "documents": [7]}, "documents[0]"),
            ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
            ("/score", {"text_1": [], "text_2": "d"}, "text_1"),
            ("/score", {"text_1": "q", "text_2": [""]}, "text_2"),
            ("/classify", {"input": []}, "input"),
            ("/rerank", {"model": "other", "query": "q", "documents": ["d"]}, "model"),
        ]
        for path, payload, param in cases:
            status, body, _ = await h.post(path, payload)
            assert status in (400, 404), (path, payload, body)
            assert body["error"]["param"] == param, (path, body)
        assert h.engine.requests == []  # refused before reaching the engine
        status, body, _ = await h.post(
            "/rerank", {"query": "q", "documents": ["word " * 600], "truncate_prompt_tokens": 64}
        )
        assert status == 200 and len(h.engine.requests[-1].prompt_token_ids) == 64


@async_test
async def test_other_tasks_refuse_each_others_endpoints(reranker, smollm2_model, tokenizer):
    async with reranking(reranker) as h:
        status, body, _ = await h.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert_error(status, body, 400, "BadRequestError")
        assert "'score' task" in body["error"]["message"]
        status, body, _ = await h.post("/v1/embeddings", {"input": "hi"})
        assert status == 400 and "'score' task" in body["error"]["message"]
    async with serving(smollm2_model, tokenizer) as h:
        for path in ("/v1/rerank", "/score", "/classify"):
            status, body, _ = await h.post(path, {"query": "q", "documents": ["d"], "text_1": "a", "text_2": "b"})
            assert status == 400 and "'generate' task" in body["error"]["message"], body
        await h.good_completion()
