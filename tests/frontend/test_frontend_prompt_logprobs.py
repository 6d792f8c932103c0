"""Prompt logprobs in vLLM's shapes against the fake engine: completions `prompt_logprobs`, `echo` with `logprobs`
(OpenAI's legacy shape, as lm-eval reads it), `max_tokens: 0` with echo, streaming, chat's top-level
`prompt_logprobs`, and the limits."""

from __future__ import annotations

import asyncio
import json

import msgspec
import numpy as np

from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tokenmill.frontend.logprobs import TokenTexts
from tokenmill.frontend.prompt_logprobs import (
    FORMAT_SLICE_VALUES,
    echo_logprobs,
    prompt_logprobs_json,
    vllm_prompt_logprobs,
)
from tokenmill.messages import PromptLogprobs

PROMPT = "The quick brown fox jumps"


def expected_prompt_logprobs(tokenizer, ids: list[int], k: int) -> list:
    """The fake engine's entries in vLLM's JSON: the token first (rank 2), then its top k (t + 1, t, t + 2)."""
    text = lambda t: tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    positions: list = [None]
    for t in ids[1:]:
        position = {str(t): {"logprob": -0.5, "rank": 2, "decoded_token": text(t)}}
        for rank, (top, logprob) in enumerate(zip([t + 1, t, t + 2][:k], [-0.25, -0.5, -3.0][:k]), start=1):
            position[str(top)] = {"logprob": logprob, "rank": rank, "decoded_token": text(top)}
        positions.append(position)
    return positions


async def sse_events(h, path: str, body: dict) -> list[dict]:
    async with h.http.post(h.url(path), json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw = (await resp.read()).decode()
    events = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@async_test
async def test_completion_prompt_logprobs_in_vllms_shape(smollm2_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    async with serving(smollm2_model, tokenizer) as h:
        status, body, _ = await h.post(
            "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2, "n": 2}
        )
        plain_status, plain, _ = await h.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and plain_status == 200, body
    assert h.engine.groups[0].sampling.prompt_logprobs == 2 and h.engine.groups[1].sampling.prompt_logprobs is None
    expected = expected_prompt_logprobs(tokenizer, ids, 2)
    assert [c["prompt_logprobs"] for c in body["choices"]] == [expected, expected]  # every choice carries them
    assert all(c["logprobs"] is None for c in body["choices"])
    assert "prompt_logprobs" not in plain["choices"][0]


@async_test
async def test_echo_with_logprobs_covers_prompt_then_completion(smollm2_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    texts = [tokenizer.decode([t]) for t in ids]
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [[500, 501]]
        status, body, _ = await h.post(
            "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1}
        )
    assert status == 200, body
    assert h.engine.requests[0].sampling.prompt_logprobs == 1  # echo + logprobs asks for prompt logprobs (vLLM)
    (choice,) = body["choices"]
    generated = [tokenizer.decode([500]), tokenizer.decode([501])]
    assert choice["text"] == PROMPT + "".join(generated)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == texts + generated
    assert logprobs["token_logprobs"] == [None] + [-0.5] * (len(ids) - 1) + [-0.25, -0.25]
    assert logprobs["top_logprobs"][0] is None
    for position, t in enumerate(ids[1:], start=1):  # the token and the first of its top list (k = 1)
        assert logprobs["top_logprobs"][position] == {tokenizer.decode([t]): -0.5, tokenizer.decode([t + 1]): -0.25}
    assert logprobs["top_logprobs"][-1] == {generated[1]: -0.25}
    lengths = [len(t) for t in texts + generated]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    assert choice["prompt_logprobs"] == expected_prompt_logprobs(tokenizer, ids, 1)  # as vLLM, when computed


@async_test
async def test_echo_with_max_tokens_0_returns_the_prompt_alone(smollm2_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [[500]]
        status, body, _ = await h.post(
            "/v1/completions", {"model": MODEL, "prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": 0}
        )
        events = await sse_events(
            h,
            "/v1/completions",
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True},
        )
        refused, error, _ = await h.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert status == 200, body
    assert h.engine.requests[0].sampling.max_tokens == 1  # the engine generates one token, not shown (vLLM)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert choice["logprobs"]["token_logprobs"] == [None] + [-0.5] * (len(ids) - 1)
    assert choice["logprobs"]["top_logprobs"][1] == {tokenizer.decode([ids[1]]): -0.5}
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 1
    streamed = [c for event in events for c in event["choices"]]
    assert "".join(c["text"] for c in streamed) == PROMPT
    assert [c["logprobs"]["tokens"] for c in streamed if c["logprobs"]] == [choice["logprobs"]["tokens"]]
    assert streamed[-1]["finish_reason"] == "length"
    assert_error(refused, error, 400, "BadRequestError", "max_tokens")  # without echo, 0 is refused (vLLM)


@async_test
async def test_streamed_echo_leads_with_the_prompt_and_its_logprobs(smollm2_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2}
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [[500, 501, 502], [500, 501, 502]]
        status, whole, _ = await h.post("/v1/completions", body)
        events = await sse_events(h, "/v1/completions", {**body, "stream": True})
    assert status == 200
    streamed = [c for event in events for c in event["choices"]]
    assert streamed[0]["text"].startswith(PROMPT)
    assert len(streamed[0]["logprobs"]["tokens"]) == len(ids) + 1  # the prompt and the first generated token
    assert "".join(c["text"] for c in streamed) == whole["choices"][0]["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [v for c in streamed if c["logprobs"] for v in c["logprobs"][key]]
        assert joined == whole["choices"][0]["logprobs"][key], key


@async_test
async def test_prompt_logprobs_with_stream_are_a_400(smollm2_model, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    async with serving(smollm2_model, tokenizer) as h:
        for path, body in [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": messages})]:
            status, error, _ = await h.post(path, {"model": MODEL, **body, "prompt_logprobs": 1, "stream": True})
            assert_error(status, error, 400, "BadRequestError", "prompt_logprobs")
            assert "stream" in error["error"]["message"]
        assert h.engine.requests == []


@async_test
async def test_chat_prompt_logprobs_are_top_level(smollm2_model, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    async with serving(smollm2_model, tokenizer) as h:
        status, body, _ = await h.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0, "n": 2},
        )
        _, plain, _ = await h.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert status == 200, body
    prompt_ids = h.engine.groups[0].prompt_token_ids
    assert body["prompt_logprobs"] == expected_prompt_logprobs(tokenizer, prompt_ids, 0)
    assert all("prompt_logprobs" not in c for c in body["choices"])
    assert "prompt_logprobs" not in plain


@async_test
async def test_echo_without_logprobs_computes_no_prompt_logprobs(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        status, body, _ = await h.post(
            "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "echo": True}
        )
    assert status == 200 and body["choices"][0]["logprobs"] is None
    assert h.engine.requests[0].sampling.prompt_logprobs is None and "prompt_logprobs" not in body["choices"][0]


def test_echo_top_logprobs_keep_the_token_and_the_first_k_of_a_longer_list(tokenizer):
    """With prompt_logprobs 3 but logprobs 1, an echoed position keeps the first 2 entries of vLLM's dict: the token,
    then the most likely other token (the token's own top entry folds into its first place)."""
    texts = TokenTexts(tokenizer)
    ids = [100, 200, 300]
    entries = PromptLogprobs.from_entries(
        [(-1.0, 1, [200, 7, 8], [-1.0, -2.0, -3.0]), (-2.5, 3, [9, 10, 300], [-0.5, -1.5, -2.5])], 3
    )
    logprobs, end = echo_logprobs(ids, entries, 1, texts)
    assert logprobs.top_logprobs == [None, {texts[200]: -1.0, texts[7]: -2.0}, {texts[300]: -2.5, texts[9]: -0.5}]
    assert logprobs.token_logprobs == [None, -1.0, -2.5] and end == sum(len(texts[t]) for t in ids)
    assert vllm_prompt_logprobs(ids, entries, texts)[1][200].rank == 1  # the top entry's rank wins (vLLM)


def long_prompt_logprobs(num_positions: int, k: int) -> tuple[list[int], PromptLogprobs]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 1000, num_positions + 1).tolist(), PromptLogprobs.from_arrays(
        -rng.random(num_positions),
        rng.integers(1, 1000, num_positions),
        rng.integers(0, 1000, (num_positions, k)),
        np.where(rng.random((num_positions, k)) < 0.1, -np.inf, -rng.random((num_positions, k))),
    )


@async_test
async def test_a_long_prompts_logprobs_are_formatted_in_slices_between_turns_of_the_event_loop(tokenizer):
    """The JSON a response embeds is vLLM's list (as the offline API builds it), and other tasks run between its
    slices: a prompt of 2,000 positions x 21 values does not hold the loop for the whole of it."""
    ids, engine_logprobs = long_prompt_logprobs(2000, 20)
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_turns())
    await asyncio.sleep(0)
    formatted = await prompt_logprobs_json(ids, engine_logprobs, TokenTexts(tokenizer))
    counter.cancel()
    slices = -(-2000 * 21 // FORMAT_SLICE_VALUES)
    assert turns >= slices - 1
    expected = msgspec.json.encode(vllm_prompt_logprobs(ids, engine_logprobs, TokenTexts(tokenizer)))
    assert json.loads(bytes(formatted)) == json.loads(expected)
    assert json.loads(bytes(formatted))[1 + 7][str(ids[8])]["rank"] > 0


@async_test
async def test_a_one_token_prompt_formats_as_one_null(tokenizer):
    assert bytes(await prompt_logprobs_json([5], PromptLogprobs(3), TokenTexts(tokenizer))) == b"[null]"
