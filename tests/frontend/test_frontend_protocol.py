"""OpenAI request decoding (errors name the field) and the conversion of requests to SamplingParams."""

from __future__ import annotations

import msgspec
import pytest

from tokenmill.frontend.errors import APIError
from tokenmill.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    chat_max_tokens,
    decode_request,
    resolve_max_tokens,
    to_sampling_params,
)

VOCAB = 1000


def completion(**fields) -> CompletionRequest:
    return decode_request(msgspec.json.encode({"prompt": "hi", **fields}), CompletionRequest)


def test_defaults_map_to_neutral_sampling():
    params = to_sampling_params(completion(), max_tokens=7, logprobs=None, vocab_size=VOCAB)
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.top_k) == (1, 7, 1.0, 1.0, 0)
    assert params.stop == [] and params.logit_bias is None and params.logprobs is None and params.skip_special_tokens


def test_every_field_is_carried_over():
    request = completion(
        temperature=0.0,
        top_p=0.5,
        top_k=-1,
        min_p=0.1,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"5": -100, "7": 2.5},
        stop="END",
        stop_token_ids=[9],
        ignore_eos=True,
        min_tokens=2,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    params = to_sampling_params(request, max_tokens=10, logprobs=3, vocab_size=VOCAB)
    assert params.greedy and params.top_p == 0.5 and params.top_k == 0 and params.min_p == 0.1
    assert (params.seed, params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        3,
        0.5,
        -0.5,
        1.2,
    )
    assert params.logit_bias == {5: -100.0, 7: 2.5}
    assert params.stop == ["END"] and params.stop_token_ids == [9] and params.ignore_eos
    assert params.min_tokens == 2 and params.logprobs == 3
    assert params.include_stop_str_in_output and not params.skip_special_tokens


def test_generation_config_defaults_fill_only_what_the_request_left_unset():
    defaults = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 8,
    }
    params = to_sampling_params(completion(), max_tokens=100, logprobs=None, vocab_size=VOCAB, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.6,
        0.9,
        20,
        0.05,
        1.1,
    )
    assert params.max_tokens == 8  # as vLLM, the generation config's max_new_tokens caps every request
    request = completion(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)
    params = to_sampling_params(request, max_tokens=5, logprobs=None, vocab_size=VOCAB, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.0,
        1.0,
        0,
        0.0,
        1.0,
    )
    assert params.max_tokens == 5


@pytest.mark.parametrize("bias, message", [({"x": 1}, "token ids"), ({"1000": 1}, "out of the vocabulary")])
def test_bad_logit_bias_is_a_400_naming_the_field(bias, message):
    with pytest.raises(APIError) as info:
        to_sampling_params(completion(logit_bias=bias), max_tokens=4, logprobs=None, vocab_size=VOCAB)
    assert info.value.status == 400 and info.value.param == "logit_bias" and message in info.value.message


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(APIError) as info:
        to_sampling_params(completion(min_tokens=5), max_tokens=4, logprobs=None, vocab_size=VOCAB)
    assert info.value.param == "min_tokens"


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),  # 0 decodes: it is allowed with echo (serving checks)
        (b'{"prompt": "x", "prompt_logprobs": -1}', "prompt_logprobs"),
        (b'{"prompt": "x", "temperature": -1}', "temperature"),
        (b'{"prompt": "x", "n": "two"}', "n"),
        (b'{"prompt": [[1, "a"]]}', "prompt[0][1]"),
        (b'{"max_tokens": 3}', "prompt"),
        (b'{"prompt": "x", "logprobs": -1}', "logprobs"),
        (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
        (b'{"prompt": "x", "seed": -9223372036854775809}', "seed"),
        (b'{"prompt": "x", "top_k": 100000000000000000000}', "top_k"),
        (b'{"prompt": "x", "priority": 100000000000000000000}', "priority"),
        (b'{"prompt": "x", "max_tokens": 100000000000000000000}', "max_tokens"),
        (b'{"prompt": "x", "min_tokens": 100000000000000000000}', "min_tokens"),
        (b'{"prompt": "x", "stop_token_ids": [100000000000000000000]}', "stop_token_ids[0]"),
    ],
)
def test_completion_validation_names_the_field(body, param):
    with pytest.raises(APIError) as info:
        decode_request(body, CompletionRequest)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"content": "x"}]}', "messages[0].role"),
        (b'{"messages": []}', "messages"),
        (b"{}", "messages"),
    ],
)
def test_chat_validation_names_the_field(body, param):
    with pytest.raises(APIError) as info:
        decode_request(body, ChatCompletionRequest)
    assert info.value.param == param


def test_malformed_json_is_a_400():
    with pytest.raises(APIError) as info:
        decode_request(b'{"prompt": ', CompletionRequest)
    assert info.value.status == 400 and "not valid JSON" in info.value.message


@pytest.mark.parametrize("body", [b'{"prompt": "caf\xc3"}', b'{"prompt": "\xed\xa0\x80"}'])
def test_invalid_utf8_in_a_string_is_a_400(body):
    with pytest.raises(APIError) as info:
        decode_request(body, CompletionRequest)
    assert info.value.status == 400 and "UTF-8" in info.value.message


def test_unknown_fields_are_ignored():
    request = decode_request(b'{"prompt": "x", "suffix": null, "best_of": 1}', CompletionRequest)
    assert request.prompt == "x"


def test_max_tokens_defaults_to_the_room_left():
    assert resolve_max_tokens(None, 10, 64) == 54
    assert resolve_max_tokens(54, 10, 64) == 54


def test_max_tokens_past_the_context_is_rejected_with_openais_message():
    with pytest.raises(APIError) as info:
        resolve_max_tokens(60, 10, 64)
    assert info.value.message.startswith(
        "This model's maximum context length is 64 tokens. However, you requested "
        "70 tokens (10 in the messages, 60 in the completion)."
    )
    with pytest.raises(APIError) as info:
        resolve_max_tokens(None, 64, 64)
    assert "your request has 64 input tokens" in info.value.message


def test_chat_token_budget_and_logprobs():
    chat = decode_request(
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, '
        b'"max_completion_tokens": 9, "logprobs": true, "top_logprobs": 2}',
        ChatCompletionRequest,
    )
    assert chat_max_tokens(chat) == 9 and chat_logprobs(chat) == 2
    plain = decode_request(b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true}', ChatCompletionRequest)
    assert chat_logprobs(plain) == 0
    bad = decode_request(b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', ChatCompletionRequest)
    with pytest.raises(APIError):
        chat_logprobs(bad)
