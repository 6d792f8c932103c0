"""API errors from a real server, as the official `openai` client (or plain HTTP) sees them.

One server serves the module, started with an API key, a small request-body limit, `--max-num-seqs 1` and
`--max-waiting-requests 2` (so one running request and two queued ones fill it). Every error case is followed by a
good request, to show the server kept serving.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tests.helpers.api_helpers import API_KEY, auth, metric, strictly_valid
from tests.helpers.server import Server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
BODY_LIMIT = 16 << 10
MAX_WAITING = 2
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("api-errors") / "server.log"
    with Server(
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        "128MiB",
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        str(MAX_WAITING),
        log_path=log_path,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def assert_still_serves(client: openai.OpenAI, model: str) -> None:
    response = strictly_valid(client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0))
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 1


def assert_error_body(response: requests.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] == error_type and error["message"]
    return error


BAD_FIELDS = [
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"prompt": 3.5}, "prompt"),
    ("completions", {"stop": 5}, "stop"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ("completions", {"extra_body": {"top_k": "x"}}, "top_k"),
    ("completions", {"extra_body": {"min_tokens": 5}, "max_tokens": 2}, "min_tokens"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"stream": "yes"}, "stream"),
    # limits, 64-bit integers, fields tokenmill does not implement, chat templates (issue 13)
    ("completions", {"n": 129}, "n"),
    ("completions", {"stop": ["x"] * 129}, "stop"),
    ("completions", {"seed": 2**64}, "seed"),
    ("completions", {"extra_body": {"priority": -(2**63) - 1}}, "priority"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "the end"}, "suffix"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    ("chat", {"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),
    ("chat", {"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs.tokenize"),
]


def test_bad_fields_are_400_naming_the_param(client, model, subtests):
    # validation happens before anything reaches the engine, so one good request after all the cases shows as much
    # as one after each
    for endpoint, fields, param in BAD_FIELDS:
        with subtests.test(param=param):
            if endpoint == "completions":
                create, base = client.completions.create, {"prompt": PROMPT, "max_tokens": 4}
            else:
                create, base = client.chat.completions.create, {"messages": [{"role": "user", "content": "Hi"}]}
            with pytest.raises(openai.BadRequestError) as caught:
                create(model=model, **{**base, **fields})
            error = caught.value
            assert (error.status_code, error.param, error.type) == (400, param, "BadRequestError"), error.body
    assert_still_serves(client, model)


def test_missing_field_and_broken_json_are_400(server, client, model):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    missing = requests.post(f"{server.url}/v1/completions", json={"model": model}, headers=headers, timeout=30)
    assert assert_error_body(missing, 400, "BadRequestError")["param"] == "prompt"
    broken = requests.post(f"{server.url}/v1/completions", data=b'{"prompt": ', headers=headers, timeout=30)
    assert "not valid JSON" in assert_error_body(broken, 400, "BadRequestError")["message"]
    assert_still_serves(client, model)


def test_unknown_model_is_404(client, model):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=1)
    assert caught.value.param == "model" and "no-such-model" in caught.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert_still_serves(client, model)


def test_api_key_guards_all_but_health_and_ping(server, client, model):
    for path in ("/v1/models", "/v1/completions"):
        response = requests.request(
            "GET" if path == "/v1/models" else "POST",
            f"{server.url}{path}",
            json={"model": model, "prompt": PROMPT},
            timeout=30,
        )
        assert_error_body(response, 401, "AuthenticationError")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).completions.create(
            model=model, prompt=PROMPT, max_tokens=1
        )
    for path in ("/health", "/ping"):
        assert requests.get(f"{server.url}{path}", timeout=30).status_code == 200, path
    for path in ("/metrics", "/version"):
        assert requests.get(f"{server.url}{path}", timeout=30).status_code == 401, path
        assert requests.get(f"{server.url}{path}", headers=auth(), timeout=30).status_code == 200, path
    assert requests.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, timeout=30).status_code == 401
    assert_still_serves(client, model)


def test_body_too_large_is_413(server, client, model):
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=model, prompt="x" * (2 * BODY_LIMIT), max_tokens=1)
    assert caught.value.status_code == 413 and str(BODY_LIMIT) in caught.value.message
    response = requests.post(
        f"{server.url}/v1/completions",
        data=b" " * (BODY_LIMIT + 1),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert_error_body(response, 413, "RequestTooLargeError")
    assert_still_serves(client, model)


def test_prompt_longer_than_the_context_is_400_with_both_numbers(server, client, model):
    long_prompt = "hello " * (MAX_MODEL_LEN + 50)
    num_tokens = requests.post(
        f"{server.url}/tokenize", json={"prompt": long_prompt}, headers=auth(), timeout=30
    ).json()["count"]
    assert num_tokens > MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=long_prompt, max_tokens=1)
    assert str(MAX_MODEL_LEN) in caught.value.message and str(num_tokens) in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_prompt}], stream=True)
    assert str(MAX_MODEL_LEN) in caught.value.message and caught.value.param == "messages"
    # a prompt that fits, with a completion budget that does not
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    assert str(MAX_MODEL_LEN) in caught.value.message and caught.value.param == "max_tokens"
    assert_still_serves(client, model)


def test_deeply_nested_json_is_400(server, client, model):
    depth = 1500  # deeper than msgspec can decode recursively; under the body limit
    tools = b'[{"type": "function", "function": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}]"
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "tools": %s}' % tools
    response = requests.post(
        f"{server.url}/v1/chat/completions",
        data=body,
        timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert "nested" in assert_error_body(response, 400, "BadRequestError")["message"]
    assert_still_serves(client, model)


def test_unknown_route_is_404(server, client, model):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for method, path in (("GET", "/v1/nothing-here"), ("POST", "/v2/completions"), ("GET", "/")):
        response = requests.request(method, f"{server.url}{path}", headers=headers, timeout=30)
        assert path in assert_error_body(response, 404, "NotFoundError")["message"]
    assert_still_serves(client, model)


def wait_for_waiting_requests(url: str, count: int, deadline_s: float = 30) -> None:
    start = time.monotonic()
    while metric(url, "vllm:num_requests_waiting") != count:
        assert time.monotonic() - start < deadline_s, f"the scheduler never had {count} waiting requests"
        time.sleep(0.1)


def test_overload_is_429_with_retry_after(server, client, model):
    # --max-num-seqs 1: a long stream holds the only running slot; two more requests fill the waiting queue
    running = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_MODEL_LEN - 16, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(running))
    with ThreadPoolExecutor(MAX_WAITING) as pool:
        queued = [
            pool.submit(client.completions.create, model=model, prompt=PROMPT, max_tokens=1) for _ in range(MAX_WAITING)
        ]
        wait_for_waiting_requests(server.url, MAX_WAITING)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
        assert caught.value.status_code == 429 and caught.value.response.headers["Retry-After"].isdigit()
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], stream=True)
        running.close()  # frees the slot: the queued requests run
        assert [f.result(timeout=120).usage.completion_tokens for f in queued] == [1] * MAX_WAITING
    assert_still_serves(client, model)
