"""Request limits (400s naming the field and the limit), integers beyond 64 bits, deep JSON, fields tokenmill does
not implement, and what the n requests of a choice carry to the engine."""

from __future__ import annotations

import pytest

from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tokenmill.config import ServerConfig
from tokenmill.frontend.errors import APIError
from tokenmill.frontend.limits import json_depth_exceeds
from tokenmill.frontend.protocol import ChatCompletionRequest, decode_request
from tokenmill.frontend.unsupported import refuse_unsupported

SMALL = dict(
    max_n=4,
    max_logprobs=3,
    max_stop_strings=2,
    max_stop_string_chars=8,
    max_stop_token_ids=2,
    max_logit_bias=2,
    max_json_depth=4,
    max_cache_salt_bytes=8,
    max_prompt_logprobs_elements=24,
)
HI = [{"role": "user", "content": "Hi"}]

OVER_LIMITS = [
    ("/v1/completions", {"n": 5}, "n", "--max-n"),
    ("/v1/completions", {"logprobs": 4}, "logprobs", "--max-logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 4}, "top_logprobs", "--max-logprobs"),
    ("/v1/completions", {"prompt_logprobs": 4}, "prompt_logprobs", "--max-logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": 4}, "prompt_logprobs", "--max-logprobs"),
    ("/v1/completions", {"stop": ["a", "b", "c"]}, "stop", "--max-stop-strings"),
    ("/v1/completions", {"stop": "123456789"}, "stop", "--max-stop-string-chars"),
    ("/v1/completions", {"stop_token_ids": [5, 6, 7]}, "stop_token_ids", "--max-stop-token-ids"),
    ("/v1/completions", {"logit_bias": {"5": 1, "6": 1, "7": 1}}, "logit_bias", "--max-logit-bias"),
    ("/v1/chat/completions", {"tools": [{"a": [[[[1]]]]}]}, "tools", "--max-json-depth"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"x": [[[[1]]]]}}, "chat_template_kwargs", "--max-json-depth"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"f": {"a": [[1]]}}]}]},
        "messages[0].tool_calls",
        "--max-json-depth",
    ),
    ("/v1/completions", {"cache_salt": "x" * 9}, "cache_salt", "--max-cache-salt-bytes"),
    ("/v1/chat/completions", {"cache_salt": "é" * 5}, "cache_salt", "--max-cache-salt-bytes"),  # 10 bytes
    # prompt tokens x (k + 1) x n: 8 tokens x 4 > 24, and the chat template's tokens x 4
    (
        "/v1/completions",
        {"prompt": "one two three four five six seven eight", "prompt_logprobs": 3},
        "prompt_logprobs",
        "--max-prompt-logprobs-elements",
    ),
    (
        "/v1/completions",
        {"prompt": "one two three four", "echo": True, "logprobs": 2, "n": 3, "max_tokens": 1},
        "prompt_logprobs",
        "--max-prompt-logprobs-elements",
    ),
    ("/v1/chat/completions", {"prompt_logprobs": 3}, "prompt_logprobs", "--max-prompt-logprobs-elements"),
]


def body_for(path: str, fields: dict) -> dict:
    base = {"prompt": "Hello", "max_tokens": 2} if path == "/v1/completions" else {"messages": HI, "max_tokens": 2}
    return {"model": MODEL, **base, **fields}


@async_test
async def test_limits_are_400s_naming_the_field_and_the_limit(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, **SMALL) as h:
        for path, fields, param, flag in OVER_LIMITS:
            status, body, _ = await h.post(path, body_for(path, fields))
            assert_error(status, body, 400, "BadRequestError", param)
            assert flag in body["error"]["message"], body
        assert h.engine.requests == []
        status, body, _ = await h.post(
            "/v1/completions",
            body_for(
                "/v1/completions",
                {"n": 4, "logprobs": 3, "stop": ["12345678", "b"], "stop_token_ids": [5, 6], "logit_bias": {"5": 1}},
            ),
        )
        assert status == 200, body
        status, body, _ = await h.post(
            "/v1/completions",
            body_for(
                "/v1/completions",
                {"prompt": "one two three four five six", "prompt_logprobs": 3, "cache_salt": "é" * 4},
            ),
        )
        assert status == 200, body


def test_default_limits_are_at_least_openais_and_vllms():
    limits = ServerConfig()
    assert limits.max_n >= 128 and limits.max_logprobs >= 20 and limits.max_stop_strings >= 4


BIG = 2**64
BEYOND_64_BITS = [
    ("seed", BIG),
    ("seed", -(2**63) - 1),
    ("top_k", BIG),
    ("priority", BIG),
    ("max_tokens", BIG),
    ("min_tokens", BIG),
    ("n", BIG),
    ("logprobs", BIG),
]


@async_test
async def test_integers_beyond_64_bits_are_400s(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        for field, value in BEYOND_64_BITS:
            status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", {field: value}))
            assert_error(status, body, 400, "BadRequestError", field)
        status, body, _ = await h.post("/v1/chat/completions", body_for("/v1/chat/completions", {"seed": BIG}))
        assert_error(status, body, 400, "BadRequestError", "seed")
        assert h.engine.requests == []
        status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", {"seed": 2**63 - 1, "n": 3}))
        assert status == 200, body


@async_test
async def test_deeply_nested_json_is_a_400_not_a_recursion_error(smollm2_model, tokenizer):
    deep_object = b'{"a": ' * 100_000 + b"1" + b"}" * 100_000
    deep_array = b"[" * 100_000 + b"]" * 100_000
    message = b'{"role": "user", "content": "x"}'
    bodies = [
        ("/v1/chat/completions", b'{"messages": [%s], "tools": [%s]}' % (message, deep_object)),
        ("/v1/chat/completions", b'{"messages": [%s], "chat_template_kwargs": %s}' % (message, deep_object)),
        ("/v1/completions", b'{"prompt": "x", "some_unknown_field": %s}' % deep_array),
        ("/tokenize", b'{"messages": [{"role": "assistant", "tool_calls": [%s]}]}' % deep_object),
    ]
    async with serving(smollm2_model, tokenizer) as h:
        for path, body in bodies:
            status, answer, _ = await h.post(path, data=body, headers={"Content-Type": "application/json"})
            assert_error(status, answer, 400, "BadRequestError")
            assert "nested" in answer["error"]["message"], answer
        await h.good_completion()


def test_json_depth():
    assert not json_depth_exceeds(1, 0) and not json_depth_exceeds([], 1) and json_depth_exceeds([[]], 1)
    assert not json_depth_exceeds({"a": [1, {"b": 2}]}, 3) and json_depth_exceeds({"a": [1, {"b": [2]}]}, 3)


UNSUPPORTED = [
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    ("/v1/chat/completions", {"documents": [{"title": "t", "text": "x"}]}, "documents"),
]
# their no-op values, and fields no schema knows, are accepted as before
NO_OPS = [
    (
        "/v1/completions",
        {
            "best_of": 1,
            "suffix": None,
            "response_format": {"type": "text"},
            "use_beam_search": False,
            "some_future_field": {"x": 1},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "tool_choice": "none",
            "parallel_tool_calls": True,
            "modalities": ["text"],
            "response_format": {"type": "text"},
            "function_call": None,
            "store": True,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "none",
            "parallel_tool_calls": False,
        },
    ),
]


@async_test
async def test_unimplemented_fields_are_400s_naming_them(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        for path, fields, param in UNSUPPORTED:
            status, body, _ = await h.post(path, body_for(path, fields))
            assert_error(status, body, 400, "BadRequestError", param)
            assert "not supported" in body["error"]["message"]
        assert h.engine.requests == []
        for path, fields in NO_OPS:
            status, body, _ = await h.post(path, body_for(path, fields))
            assert status == 200, (fields, body)


def test_refuse_unsupported_names_the_field():
    request = decode_request(
        b'{"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}', ChatCompletionRequest
    )
    with pytest.raises(APIError) as info:
        refuse_unsupported(request)
    assert info.value.param == "functions" and "tools" in info.value.message


@async_test
async def test_choices_share_one_engine_parameter_set_without_stop_strings(smollm2_model, tokenizer):
    stops = ["never-appears-1", "never-appears-2"]
    async with serving(smollm2_model, tokenizer) as h:
        status, body, _ = await h.post(
            "/v1/completions", body_for("/v1/completions", {"n": 3, "stop": stops, "logit_bias": {"5": 1.5}})
        )
        assert status == 200 and len(body["choices"]) == 3
        params = [r.sampling for r in h.engine.requests]
        # stop strings are matched in the frontend: the engine never gets them; unseeded choices share one object
        assert all(p.stop == [] and p.logit_bias == {5: 1.5} for p in params)
        assert params[0] is params[1] is params[2]
        h.engine.requests.clear()
        status, body, _ = await h.post(
            "/v1/completions", body_for("/v1/completions", {"n": 2, "seed": 7, "stop": ["lo"], "prompt": "Hello"})
        )
        assert [r.sampling.seed for r in h.engine.requests] == [7, 8]
        assert all(r.sampling.stop == [] for r in h.engine.requests)
        # the stop string still ends each choice (the fake engine echoes the prompt)
        assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop"]
