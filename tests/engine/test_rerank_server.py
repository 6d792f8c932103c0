"""A real `tokenmill serve` of a random-weight BERT cross-encoder (cross-encoder/ms-marco-MiniLM-L-6-v2's config at
tiny sizes) against sentence-transformers' CrossEncoder.predict, through /v1/rerank, /score and /classify, in float32;
and the instance's refusal of the chat endpoints, with every other request undisturbed."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from tests.helpers.cross_encoders import build_bert_cross_encoder
from tests.helpers.server import Server

pytestmark = pytest.mark.slow

NAME = "reranker"
QUERY = "how does paged attention store the KV cache?"
DOCUMENTS = [
    "Paged attention stores keys and values in fixed-size blocks allocated on demand.",
    "The cat sat on the mat.",
    "Blocks",
    "A prefix cache shares the blocks of a common prompt prefix between requests. " * 3,
    "Speculative decoding drafts tokens and verifies them in one step.",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_bert_cross_encoder(tmp_path_factory.mktemp("ce"))


@pytest.fixture(scope="module")
def expected(checkpoint) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(checkpoint), device="cpu").predict([(QUERY, doc) for doc in DOCUMENTS])


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("rerank-server") / "server.log"
    args = (str(checkpoint), "--served-model-name", NAME, "--dtype", "float32")
    with Server(*args, log_path=log) as running:
        yield running


def post(server: Server, path: str, body: dict) -> tuple[int, dict]:
    response = requests.post(f"{server.url}{path}", json=body, timeout=60)
    return response.status_code, response.json()


def test_rerank_equals_cross_encoder_predict(server, expected):
    status, body = post(server, "/v1/rerank", {"model": NAME, "query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    order = list(np.argsort(-expected, kind="stable"))
    assert [r["index"] for r in body["results"]] == order
    got = np.array([r["relevance_score"] for r in body["results"]])
    np.testing.assert_allclose(got, expected[order], atol=1e-4, rtol=0)
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]


def test_score_and_classify_equal_cross_encoder_predict(server, expected):
    status, body = post(server, "/score", {"model": NAME, "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-4, rtol=0)
    status, body = post(server, "/v1/score", {"text_1": [QUERY] * 2, "text_2": DOCUMENTS[:2]})
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected[:2], atol=1e-4, rtol=0)
    status, body = post(server, "/classify", {"input": DOCUMENTS[:2]})
    assert status == 200 and [d["num_classes"] for d in body["data"]] == [1, 1], body
    assert body["data"][0]["label"] == "LABEL_0"


def test_wrong_endpoints_and_bad_input_are_400_and_disturb_nothing(server, expected):
    status, body = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and "'score' task" in body["error"]["message"], body
    status, body = post(server, "/v1/rerank", {"query": QUERY, "documents": ["word " * 2000]})
    assert status == 400 and body["error"]["param"] == "documents", body
    status, body = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert status == 200 and [r["index"] for r in body["results"]] == list(np.argsort(-expected, kind="stable"))[:2]
    health = requests.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200
