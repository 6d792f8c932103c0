"""Deadlines and billing usage against a real server (SmolLM2 on CPU): a request's `timeout` and --request-timeout end
it with what it has (finish_reason "length", stop_reason "timeout"), --max-queue-time refuses a request that could not
start (503 with Retry-After, nothing leaked), a dropped stream frees its request at once, and usage carries
`prompt_tokens_details.cached_tokens` (chat, completions, responses), on every chunk when asked, and on the final chunk
of a stream a deadline ended.

The server runs two sequences at most, so the queue test can fill it."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from tests.helpers.api_helpers import metric
from tests.helpers.server import Server

MAX_MODEL_LEN = 4096
MAX_QUEUE_TIME_S = 3.0
REQUEST_TIMEOUT_S = 20.0
LONG = 3000  # tokens no request here gets to generate before its deadline, even on a fast idle CPU
PROMPT = "Once upon a time, in a land far away, there lived a"
SHARED = "You are a careful assistant who answers in full sentences and never rushes. " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("deadlines") / "server.log"
    with Server(
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        "512MiB",  # two sequences of LONG tokens
        "--max-num-seqs",
        "2",
        "--max-queue-time",
        str(MAX_QUEUE_TIME_S),
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        log_path=log_path,
        startup_timeout=600,
    ) as server:
        yield server


def post(server: Server, path: str, body: dict, stream: bool = False) -> requests.Response:
    return requests.post(f"{server.url}{path}", json={"model": model_id(server), **body}, timeout=300, stream=stream)


def model_id(server: Server) -> str:
    return requests.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]


def sse_events(response: requests.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(json.loads(line[len(b"data: ") :]))
    return events


def wait_until_idle(server: Server, deadline_s: float = 30.0) -> float:
    """Seconds until /metrics shows no running or waiting request and no KV block in use."""
    start = time.monotonic()
    while True:
        idle = all(
            metric(server.url, name) == 0
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        )
        waited = time.monotonic() - start
        if idle:
            return waited
        assert waited < deadline_s, "requests or KV blocks still held"
        time.sleep(0.1)


def test_models_card_has_max_model_len_and_a_null_parent(server):
    card = requests.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN and "parent" in card and card["parent"] is None


def test_a_request_timeout_ends_a_completion_with_what_it_has(server):
    start = time.monotonic()
    body = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "timeout": 2.0}
    ).json()
    elapsed = time.monotonic() - start
    choice = body["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", "timeout")
    # ended at the first step after its deadline (a step on a busy CPU may take seconds), far short of LONG tokens
    assert 0 <= body["usage"]["completion_tokens"] < LONG and elapsed < 60
    wait_until_idle(server)


def test_a_deadline_ends_a_stream_with_usage_on_every_chunk_and_the_last(server):
    response = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": LONG,
            "ignore_eos": True,
            "timeout": 2.0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        stream=True,
    )
    assert response.status_code == 200
    events = sse_events(response)
    *choice_chunks, usage_chunk = events
    assert all(chunk["usage"] is not None for chunk in choice_chunks)  # continuous_usage_stats
    last = choice_chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("length", "timeout")
    usage = usage_chunk["usage"]
    assert usage_chunk["choices"] == [] and 0 < usage["completion_tokens"] < LONG
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_the_server_request_timeout_bounds_a_request_without_its_own(server):
    start = time.monotonic()
    body = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}).json()
    assert body["choices"][0]["stop_reason"] == "timeout"
    assert time.monotonic() - start >= REQUEST_TIMEOUT_S - 0.5


def test_a_responses_timeout_ends_it_incomplete(server):
    body = post(
        server, "/v1/responses", {"input": PROMPT, "max_output_tokens": LONG, "ignore_eos": True, "timeout": 2.0}
    ).json()
    assert body["status"] == "incomplete" and 0 < body["usage"]["output_tokens"] < LONG


def test_a_request_that_cannot_start_within_max_queue_time_gets_503_and_leaks_nothing(server):
    # both sequences taken for longer than the queue limit (--request-timeout ends them), one after the other so that
    # neither waits behind the other's first step (seconds on a busy CPU)
    blocked: list[dict] = []
    blockers = [
        threading.Thread(
            target=lambda i=i: blocked.append(
                post(
                    server, "/v1/completions", {"prompt": f"{PROMPT} {i}", "max_tokens": LONG, "ignore_eos": True}
                ).json()
            )
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 60
    for running, thread in enumerate(blockers, start=1):
        thread.start()
        while metric(server.url, "vllm:num_requests_running") < running:
            assert time.monotonic() < deadline, f"blocker {running} never ran"
            time.sleep(0.1)
    response = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    for thread in blockers:
        thread.join()
    assert [b["choices"][0]["stop_reason"] for b in blocked] == ["timeout"] * 2, blocked
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    error = response.json()["error"]
    assert error["code"] == 503 and "--max-queue-time" in error["message"]
    wait_until_idle(server)


def test_a_dropped_stream_frees_its_request_within_a_step_or_two(server):
    response = post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True},
        stream=True,
    )
    lines = response.iter_lines()
    received = 0
    while received < 3:
        received += next(lines).startswith(b"data: ")
    deadline = time.monotonic() + 30
    while metric(server.url, "vllm:num_requests_running") < 1:  # /metrics lags the engine by up to half a second
        assert time.monotonic() < deadline, "the stream's request never showed as running"
        time.sleep(0.05)
    response.close()
    assert wait_until_idle(server, deadline_s=REQUEST_TIMEOUT_S / 2) < REQUEST_TIMEOUT_S / 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_prefix_cache_hits_are_billed_as_cached_tokens(server, path):
    prompt = f"{SHARED} ({path})"
    body = (
        {"prompt": prompt, "max_tokens": 1}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
        if path == "/v1/chat/completions"
        else {"input": prompt, "max_output_tokens": 1}
    )
    first, second = (post(server, path, body).json()["usage"] for _ in range(2))
    details = "input_tokens_details" if path == "/v1/responses" else "prompt_tokens_details"
    prompt_tokens = first["input_tokens" if path == "/v1/responses" else "prompt_tokens"]
    assert first[details]["cached_tokens"] < second[details]["cached_tokens"]
    assert prompt_tokens - 16 <= second[details]["cached_tokens"] < prompt_tokens  # all whole blocks but the last
