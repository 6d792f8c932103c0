"""The HTTP app end to end (aiohttp TestServer + the official `openai` client) against a fake engine."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from tests.helpers.frontend_fakes import EOS_ID
from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tokenmill.config import replace
from tokenmill.messages import SchedulerStats

# ------------------------------------------------------------------------------------------ completions


@async_test
async def test_completion_echoes_prompt_tokens(smollm2_model, tokenizer):
    ids = tokenizer.encode("Hello world, how are you")
    async with serving(smollm2_model, tokenizer) as h:
        resp = await h.client.completions.create(model=MODEL, prompt="Hello world, how are you", max_tokens=3)
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == tokenizer.decode(ids[:3])
    assert resp.choices[0].finish_reason == "length"
    usage = resp.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 3, len(ids) + 3)
    assert h.engine.requests[0].sampling.max_tokens == 3 and h.engine.requests[0].prompt_token_ids == ids


@async_test
async def test_completion_default_max_tokens_is_16_and_null_is_the_room_left(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        await h.client.completions.create(model=MODEL, prompt="Hi there")
        resp = await h.client.completions.create(model=MODEL, prompt="Hi there", extra_body={"max_tokens": None})
    assert h.engine.requests[0].sampling.max_tokens == 16  # the legacy completions default, as OpenAI and vLLM
    assert h.engine.requests[1].sampling.max_tokens == smollm2_model.max_model_len - resp.usage.prompt_tokens


@async_test
async def test_completion_stream_with_usage(smollm2_model, tokenizer):
    prompt = "Streaming: naïve café 😀 works"
    ids = tokenizer.encode(prompt)
    async with serving(smollm2_model, tokenizer) as h:
        stream = await h.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=len(ids), stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.text for chunk in chunks for c in chunk.choices)
    finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert text == prompt and finishes == ["length"]
    assert all("\ufffd" not in c.text for chunk in chunks for c in chunk.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert all(chunk.usage is None for chunk in chunks[:-1])


@async_test
async def test_completion_many_prompts_and_n(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        resp = await h.client.completions.create(
            model=MODEL, prompt=["one two three", "four five six"], n=2, seed=5, max_tokens=2
        )
        requests = {r.request_id: r for r in h.engine.requests}
        groups = h.engine.groups
    assert [(g.sampling.n, len(g.prompt_token_ids) > 0) for g in groups] == [(2, True), (2, True)]  # one per prompt
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    first, second = (tokenizer.decode(tokenizer.encode(p)[:2]) for p in ["one two three", "four five six"])
    assert [c.text for c in resp.choices] == [first, first, second, second]
    assert {rid: r.sampling.seed for rid, r in requests.items()} == {
        f"{resp.id}-0-0": 5,
        f"{resp.id}-0-1": 6,
        f"{resp.id}-1-0": 5,
        f"{resp.id}-1-1": 6,
    }  # prompt, then choice
    prompt_tokens = len(tokenizer.encode("one two three")) + len(tokenizer.encode("four five six"))
    assert resp.usage.prompt_tokens == prompt_tokens and resp.usage.completion_tokens == 8


@async_test
async def test_completion_token_id_prompts_and_echo(smollm2_model, tokenizer):
    a, b = tokenizer.encode("Alpha beta"), tokenizer.encode("Gamma delta epsilon")
    async with serving(smollm2_model, tokenizer) as h:
        single = await h.client.completions.create(model=MODEL, prompt=a, max_tokens=1)
        double = await h.client.completions.create(model=MODEL, prompt=[a, b], max_tokens=2, echo=True)
    assert single.choices[0].text == tokenizer.decode(a[:1])
    assert [c.text for c in double.choices] == [
        "Alpha beta" + tokenizer.decode(a[:2]),
        "Gamma delta epsilon" + tokenizer.decode(b[:2]),
    ]


@async_test
async def test_completion_logprobs(smollm2_model, tokenizer):
    ids = tokenizer.encode("Hello world again")
    async with serving(smollm2_model, tokenizer) as h:
        resp = await h.client.completions.create(model=MODEL, prompt="Hello world again", max_tokens=3, logprobs=2)
    logprobs = resp.choices[0].logprobs
    assert h.engine.requests[0].sampling.logprobs == 2
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids[:3]]
    assert logprobs.token_logprobs == [-0.25] * 3
    assert logprobs.text_offset == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0]) + len(logprobs.tokens[1])]
    assert all(len(top) == 2 and top[tok] == -0.25 for top, tok in zip(logprobs.top_logprobs, logprobs.tokens))


@async_test
async def test_stop_string_ends_and_aborts(smollm2_model, tokenizer):
    reply = tokenizer.encode("one two three four five") + [EOS_ID]
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [list(reply), list(reply)]
        resp = await h.client.completions.create(model=MODEL, prompt="count", max_tokens=20, stop=["three", "zzz"])
        assert h.engine.aborted == [f"{resp.id}-0"]
        stream = await h.client.completions.create(
            model=MODEL, prompt="count", max_tokens=20, stop="three", stream=True
        )
        chunks = [c async for c in stream]
    choice = resp.choices[0]
    assert choice.text == "one two " and choice.finish_reason == "stop" and choice.stop_reason == "three"
    assert "".join(c.choices[0].text for c in chunks) == "one two "
    assert [c.choices[0].stop_reason for c in chunks if c.choices[0].finish_reason] == ["three"]
    assert len(h.engine.aborted) == 2


@async_test
async def test_stop_token_ids_and_eos(smollm2_model, tokenizer):
    stop_id = tokenizer.encode(" world")[0]
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [
            tokenizer.encode("Hello world more"),
            tokenizer.encode("Hello world more"),
            tokenizer.encode("Bye") + [EOS_ID],
        ]
        hidden = await h.client.completions.create(
            model=MODEL, prompt="x", max_tokens=9, extra_body={"stop_token_ids": [stop_id]}
        )
        shown = await h.client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=9,
            extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": True},
        )
        eos = await h.client.completions.create(model=MODEL, prompt="x", max_tokens=9)
    assert (hidden.choices[0].text, hidden.choices[0].stop_reason) == ("Hello", stop_id)
    assert hidden.usage.completion_tokens == 2  # the stop token is counted, not rendered
    assert shown.choices[0].text == "Hello world"
    assert (eos.choices[0].text, eos.choices[0].finish_reason, eos.choices[0].stop_reason) == ("Bye", "stop", None)


# ------------------------------------------------------------------------------------------ chat


@async_test
async def test_chat_completion(smollm2_model, tokenizer):
    reply = tokenizer.encode("Hi there! 😀") + [EOS_ID]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]},
    ]
    expected_prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say\nhi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [reply]
        resp = await h.client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=50, temperature=0.0, extra_body={"top_k": 5}
        )
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == "Hi there! 😀"
    assert choice.finish_reason == "stop" and choice.stop_reason is None
    request = h.engine.requests[0]
    assert request.prompt_token_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.top_k) == (50, 0.0, 5)
    assert resp.usage.prompt_tokens == len(request.prompt_token_ids) and resp.usage.completion_tokens == len(reply)


@async_test
async def test_chat_stream_n2_with_usage(smollm2_model, tokenizer):
    text = "Ünïcödé 🚀 streaming"
    reply = tokenizer.encode(text) + [EOS_ID]
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [list(reply), list(reply)]
        stream = await h.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "go"}],
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    for index in (0, 1):
        own = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert own[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in own) == text
        assert [c.finish_reason for c in own if c.finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(reply)
    assert all(c.object == "chat.completion.chunk" for c in chunks)


@async_test
async def test_chat_logprobs(smollm2_model, tokenizer):
    reply = tokenizer.encode("Sure thing") + [EOS_ID]
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [reply]
        resp = await h.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "ok?"}], logprobs=True, top_logprobs=2
        )
    content = resp.choices[0].logprobs.content
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in reply]
    assert all(e.logprob == -0.25 and len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    assert content[0].top_logprobs[1].token == tokenizer.decode([reply[0] + 1])


# ------------------------------------------------------------------------------------------ errors


@async_test
async def test_bad_requests_are_400_naming_the_field(smollm2_model, tokenizer):
    long_prompt = " ".join(["word"] * 300)
    async with serving(smollm2_model, tokenizer) as h:
        cases = [
            ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
            ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
            ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1000}, "max_tokens"),
            ("/v1/completions", {"model": MODEL, "prompt": long_prompt}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": [10, 99999]}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
            (
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                },
                "messages[0].content[0].type",
            ),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}], "n": 0}, "n"),
        ]
        for path, body, param in cases:
            status, error, _ = await h.post(path, body)
            assert_error(status, error, 400, "BadRequestError", param)
            await h.good_completion()
        status, error, _ = await h.post(
            "/v1/completions", data=b'{"prompt": ', headers={"Content-Type": "application/json"}
        )
        assert_error(status, error, 400, "BadRequestError")
        status, error, _ = await h.post("/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 5})
        assert (
            "maximum context length is 256 tokens. However, your request has 300 input tokens"
            in error["error"]["message"]
        )
        with pytest.raises(openai.BadRequestError):
            await h.client.completions.create(model=MODEL, prompt="x", top_p=5)
        await h.good_completion()


@async_test
async def test_engine_rejection_is_a_400(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.reject_with = "prompt has a token the model cannot take"
        for stream in (False, True):
            status, error, _ = await h.post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": stream})
            assert_error(status, error, 400, "BadRequestError")
            assert error["error"]["message"] == "prompt has a token the model cannot take"
        h.engine.reject_with = None
        await h.good_completion()


@async_test
async def test_api_key(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, api_key="s3cret") as h:
        status, error, _ = await h.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert_error(status, error, 401, "AuthenticationError")
        status, error, _ = await h.post(
            "/v1/completions", {"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer wrong"}
        )
        assert_error(status, error, 401, "AuthenticationError")
        wrong = AsyncOpenAI(base_url=h.url("/v1"), api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        await wrong.close()
        for open_path in ("/health", "/ping"):  # the only open paths (tests/frontend/test_frontend_side_doors.py)
            async with h.http.get(h.url(open_path)) as resp:
                assert resp.status == 200, open_path
        await h.good_completion()


@async_test
async def test_unknown_model_and_route_are_404(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        with pytest.raises(openai.NotFoundError) as info:
            await h.client.completions.create(model="gpt-17", prompt="x")
        assert info.value.body["param"] == "model"
        async with h.http.get(h.url("/v1/nothing-here")) as resp:
            assert_error(resp.status, await resp.json(), 404, "NotFoundError")
        await h.good_completion()


@async_test
async def test_body_too_large_is_413(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, max_request_body_bytes=1024) as h:
        status, error, _ = await h.post("/v1/completions", {"model": MODEL, "prompt": "x" * 2000})
        assert_error(status, error, 413, "RequestTooLargeError")
        await h.good_completion()


@async_test
async def test_full_queue_is_429_with_retry_after(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, max_waiting=4) as h:
        h.engine.latest_stats = SchedulerStats(
            num_running=8,
            num_waiting=4,
            kv_cache_usage=0.9,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
        )
        status, error, headers = await h.post(
            "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert_error(status, error, 429, "RateLimitError")
        assert headers["Retry-After"] == "1"
        h.engine.latest_stats = None
        await h.good_completion()


@async_test
async def test_dead_engine_is_503(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.dead_reason = "tokenmill-worker0 (pid 1) exited with code -9"
        status, error, _ = await h.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert_error(status, error, 503, "ServiceUnavailableError")
        async with h.http.get(h.url("/health")) as resp:
            assert resp.status == 503 and "exited with code -9" in (await resp.json())["error"]["message"]
        h.engine.dead_reason = None
        async with h.http.get(h.url("/health")) as resp:
            assert resp.status == 200
        await h.good_completion()


@async_test
async def test_engine_dying_mid_stream_sends_an_error_event(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.step_delay_s = 0.01
        async with h.http.post(
            h.url("/v1/completions"), json={"model": MODEL, "prompt": "a b c d e f g h", "stream": True}
        ) as resp:
            assert resp.status == 200
            await resp.content.readline()
            h.engine.dead_reason = "scheduler died"
            body = (await resp.read()).decode()
        assert '"code":503' in body and body.endswith("data: [DONE]\n\n")


@async_test
async def test_wrong_task_endpoints_are_400(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        status, error, _ = await h.post("/v1/embeddings", {"model": MODEL, "input": "x"})
        assert_error(status, error, 400, "BadRequestError")
        assert "generate" in error["error"]["message"]
    async with serving(replace(smollm2_model, task="embed"), tokenizer) as h:
        for path, body in [
            ("/v1/completions", {"model": MODEL, "prompt": "x"}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
        ]:
            status, error, _ = await h.post(path, body)
            assert_error(status, error, 400, "BadRequestError")
            assert "embed" in error["error"]["message"]


# ------------------------------------------------------------------------------------------ disconnects


@async_test
async def test_disconnect_mid_stream_aborts(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.hold = True
        resp = await h.http.post(
            h.url("/v1/chat/completions"),
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2},
        )
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()  # drop the connection
        await asyncio.wait_for(h.engine.aborted_event.wait(), 5)
        await asyncio.sleep(0.05)
        assert sorted(h.engine.aborted) == sorted(r.request_id for r in h.engine.requests)
        h.engine.hold = False
        await h.good_completion()


@async_test
async def test_disconnect_before_a_non_streamed_answer_aborts(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.hold = True
        with pytest.raises(asyncio.TimeoutError):
            await h.http.post(
                h.url("/v1/completions"),
                json={"model": MODEL, "prompt": "hello there"},
                timeout=aiohttp.ClientTimeout(total=0.5),
            )
        await asyncio.wait_for(h.engine.aborted_event.wait(), 5)
        assert h.engine.aborted == [h.engine.requests[0].request_id]


# ------------------------------------------------------------------------------------------ small endpoints


@async_test
async def test_models_version_tokenize_detokenize(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        models = await h.client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert models.data[0].model_extra["max_model_len"] == 256
        async with h.http.get(h.url("/version")) as resp:
            assert (await resp.json())["version"]
        status, body, _ = await h.post("/tokenize", {"prompt": "Hello world 😀", "return_token_strs": True})
        assert status == 200 and body["tokens"] == tokenizer.encode("Hello world 😀")
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256 and body["token_strs"]
        status, chat, _ = await h.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
        assert chat["tokens"][0] == 1 and chat["tokens"][-3:] == tokenizer.encode("assistant\n")
        status, body, _ = await h.post("/detokenize", {"tokens": body["tokens"]})
        assert status == 200 and body["prompt"] == "Hello world 😀"
        status, error, _ = await h.post("/detokenize", {"tokens": [10**6]})
        assert_error(status, error, 400, "BadRequestError", "tokens")


@async_test
async def test_metrics(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.latest_stats = SchedulerStats(
            num_running=3,
            num_waiting=1,
            kv_cache_usage=0.5,
            prefix_cache_queries=40,
            prefix_cache_hits=16,
            num_preemptions=2,
        )
        resp = await h.client.completions.create(model=MODEL, prompt="one two three", max_tokens=2)
        async with h.http.get(h.url("/metrics")) as http_resp:
            text = await http_resp.text()
    label = f'{{model_name="{MODEL}"}}'
    for line in [
        f"vllm:num_requests_running{label} 3.0",
        f"vllm:num_requests_waiting{label} 1.0",
        f"vllm:kv_cache_usage_perc{label} 0.5",
        f"vllm:prefix_cache_queries_total{label} 40.0",
        f"vllm:prefix_cache_hits_total{label} 16.0",
        f"vllm:num_preemptions_total{label} 2.0",
        f"vllm:prompt_tokens_total{label} {resp.usage.prompt_tokens}.0",
        f"vllm:generation_tokens_total{label} 2.0",
        f"vllm:time_to_first_token_seconds_count{label} 1.0",
        f"vllm:inter_token_latency_seconds_count{label} 1.0",
        f"vllm:e2e_request_latency_seconds_count{label} 1.0",
    ]:
        assert line in text, line


@async_test
async def test_cors(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, allowed_origins=["http://app.example"]) as h:
        async with h.http.get(h.url("/v1/models"), headers={"Origin": "http://app.example"}) as resp:
            assert resp.headers["Access-Control-Allow-Origin"] == "http://app.example"
        async with h.http.get(h.url("/v1/models"), headers={"Origin": "http://evil.example"}) as resp:
            assert "Access-Control-Allow-Origin" not in resp.headers
        async with h.http.options(
            h.url("/v1/chat/completions"),
            headers={
                "Origin": "http://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        ) as resp:
            assert resp.status == 200 and "POST" in resp.headers["Access-Control-Allow-Methods"]
            assert resp.headers["Access-Control-Allow-Origin"] == "http://app.example"
