"""Tool calling and reasoning in /v1/chat/completions against the fake engine: response shapes (whole and streamed,
through the official `openai` client's types), finish reasons, what reaches the engine (structured outputs for a
forced tool_choice, special tokens), the multi-turn template round trip, and the 400s."""

from __future__ import annotations

import copy
import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.helpers.chat_templates import HERMES_TOOL_TEMPLATE
from tests.helpers.frontend_fakes import EOS_ID
from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tokenmill.config import replace
from tokenmill.frontend.reasoning_parsers import end_marker_ids, get_reasoning_parser

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "Weather in Paris and the time?"}]
AUTO = dict(tool_call_parser="hermes", enable_auto_tool_choice=True)
TWO_CALLS = (
    'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def model(smollm2_model):
    return replace(smollm2_model, max_model_len=4096)  # room for the tools in the prompt


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    """The SmolLM2 tokenizer with a Qwen2.5-style template that renders tools and tool calls."""
    templated = copy.copy(tokenizer)
    templated.chat_template = HERMES_TOOL_TEMPLATE
    return templated


def reply(tokenizer, text: str, eos: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + ([EOS_ID] if eos else [])


def body(**fields) -> dict:
    return {"model": MODEL, "messages": ASK, "max_tokens": 200, **fields}


async def whole(h, **fields) -> ChatCompletion:
    status, answer, _ = await h.post("/v1/chat/completions", body(**fields))
    assert status == 200, answer
    return ChatCompletion.model_validate(answer)


async def streamed(h, **fields) -> list[ChatCompletionChunk]:
    stream = await h.client.chat.completions.create(stream=True, **body(**fields))
    return [ChatCompletionChunk.model_validate(chunk.to_dict()) async for chunk in stream]


def reassemble(chunks: list[ChatCompletionChunk], index: int = 0) -> dict:
    """A choice's streamed deltas put together as a client does; checks each call's first delta carries its id,
    type and name and later ones only arguments."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.type == "function" and call.function.name, call
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None, call
                calls[call.index]["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                assert finish is None
                finish = choice.finish_reason
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "finish": finish,
        "calls": [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)],
        "ids": [calls[i]["id"] for i in sorted(calls)],
    }


def summary(response: ChatCompletion, index: int = 0) -> dict:
    choice = response.choices[index]
    message = choice.message
    return {
        "content": message.content,
        "reasoning": getattr(message, "reasoning_content", None),
        "finish": choice.finish_reason,
        "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
        "ids": [c.id for c in message.tool_calls or []],
    }


def same_but_ids(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k != "ids"} == {k: v for k, v in b.items() if k != "ids"}


# ------------------------------------------------------------------------------------------ tool_choice auto


@async_test
async def test_auto_tool_calls_whole_and_streamed(model, tool_tokenizer):
    async with serving(model, tool_tokenizer, **AUTO) as h:
        h.engine.replies = [reply(tool_tokenizer, TWO_CALLS), reply(tool_tokenizer, TWO_CALLS)]
        response = await whole(h, tools=TOOLS)
        chunks = await streamed(h, tools=TOOLS)
    got = summary(response)
    assert got["content"] == "I will check.\n" and got["finish"] == "tool_calls"
    assert got["calls"] == [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")]
    assert all(i.startswith("chatcmpl-tool-") for i in got["ids"]) and len(set(got["ids"])) == 2
    assert response.choices[0].message.tool_calls[0].type == "function"
    assert same_but_ids(reassemble(chunks), got)
    assert chunks[0].choices[0].delta.role == "assistant"
    # the call's first delta came before the output ended: arguments are streamed, not sent at the end
    first_call = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    assert first_call < len(chunks) - 3


@async_test
async def test_auto_without_a_call_is_plain_content_and_a_cut_call_stays_length(model, tool_tokenizer):
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    async with serving(model, tool_tokenizer, **AUTO) as h:
        h.engine.replies = [
            reply(tool_tokenizer, "It is sunny."),
            reply(tool_tokenizer, cut, eos=False),
            reply(tool_tokenizer, cut, eos=False),
        ]
        plain = summary(await whole(h, tools=TOOLS))
        truncated = summary(await whole(h, tools=TOOLS))
        truncated_stream = reassemble(await streamed(h, tools=TOOLS))
    assert plain == {"content": "It is sunny.", "reasoning": None, "finish": "stop", "calls": [], "ids": []}
    # as vLLM: a malformed (here cut) call is content when the whole output is returned ...
    assert truncated == {"content": cut, "reasoning": None, "finish": "length", "calls": [], "ids": []}
    # ... while a stream has already sent it: the call as far as it went, and "length"
    assert truncated_stream["finish"] == "length" and truncated_stream["calls"][0][0] == "get_weather"


@async_test
async def test_tool_choice_none_never_parses_and_tools_still_render(model, tool_tokenizer):
    async with serving(model, tool_tokenizer, **AUTO) as h:
        h.engine.replies = [reply(tool_tokenizer, TWO_CALLS)]
        got = summary(await whole(h, tools=TOOLS, tool_choice="none"))
        prompt = tool_tokenizer.decode(h.engine.requests[0].prompt_token_ids)
    assert got == {"content": TWO_CALLS, "reasoning": None, "finish": "stop", "calls": [], "ids": []}
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt


@async_test
async def test_parallel_tool_calls_false_keeps_the_first_call(model, tool_tokenizer):
    async with serving(model, tool_tokenizer, **AUTO) as h:
        h.engine.replies = [reply(tool_tokenizer, TWO_CALLS), reply(tool_tokenizer, TWO_CALLS)]
        got = summary(await whole(h, tools=TOOLS, parallel_tool_calls=False))
        chunks = await streamed(h, tools=TOOLS, parallel_tool_calls=False)
        status, answer, _ = await h.post(
            "/v1/chat/completions", body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        )
        schema = json.loads(h.engine.requests[-1].sampling.structured_outputs.json)
    assert got["calls"] == [("get_weather", '{"city": "Paris", "days": 2}')] and got["finish"] == "tool_calls"
    assert same_but_ids(reassemble(chunks), got)
    assert status == 200 and schema["maxItems"] == 1


@async_test
async def test_n_choices_are_parsed_independently(model, tool_tokenizer):
    async with serving(model, tool_tokenizer, **AUTO) as h:
        h.engine.replies = [reply(tool_tokenizer, TWO_CALLS), reply(tool_tokenizer, TWO_CALLS)]  # one per choice
        chunks = await streamed(h, tools=TOOLS, n=2)
    first, second = reassemble(chunks, 0), reassemble(chunks, 1)
    assert same_but_ids(first, second) and len(first["calls"]) == 2 and first["finish"] == "tool_calls"
    assert set(first["ids"]).isdisjoint(second["ids"])


@async_test
async def test_mistral_parser_keeps_special_tokens(model, tool_tokenizer):
    async with serving(model, tool_tokenizer, tool_call_parser="mistral", enable_auto_tool_choice=True) as h:
        h.engine.replies = [reply(tool_tokenizer, "[TOOL_CALLS]get_time{}")]
        got = summary(await whole(h, tools=TOOLS))
        await whole(h, tools=TOOLS, tool_choice="none")
    assert got["calls"] == [("get_time", "{}")] and len(got["ids"][0]) == 9
    assert [r.sampling.skip_special_tokens for r in h.engine.requests] == [False, True]


# ------------------------------------------------------------------------------------------ forced tool_choice


@async_test
async def test_required_is_enforced_with_a_schema_and_read_as_json(model, tool_tokenizer):
    output = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'
    async with serving(model, tool_tokenizer) as h:  # no --enable-auto-tool-choice needed, as vLLM
        h.engine.replies = [reply(tool_tokenizer, output), reply(tool_tokenizer, output)]
        got = summary(await whole(h, tools=TOOLS, tool_choice="required"))
        chunks = await streamed(h, tools=TOOLS, tool_choice="required")
        constraint = h.engine.requests[0].sampling.structured_outputs
    assert got["calls"] == [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    assert got["content"] is None and got["finish"] == "tool_calls"
    assert same_but_ids(reassemble(chunks), got)
    schema = json.loads(constraint.json)
    assert constraint.begin_after_token_ids is None
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"]["enum"] for v in variants] == [["get_weather"], ["get_time"]]
    assert variants[0]["properties"]["parameters"] == WEATHER_PARAMETERS
    assert all(v["required"] == ["name", "parameters"] for v in variants)


@async_test
async def test_named_function_is_enforced_with_its_parameters_schema(model, tool_tokenizer):
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with serving(model, tool_tokenizer) as h:
        h.engine.replies = [reply(tool_tokenizer, '{"city":"Paris"}'), reply(tool_tokenizer, '{"city":"Paris"}')]
        got = summary(await whole(h, tools=TOOLS, tool_choice=named))
        chunks = await streamed(h, tools=TOOLS, tool_choice=named)
        constraint = h.engine.requests[0].sampling.structured_outputs
    assert got["calls"] == [("get_weather", '{"city":"Paris"}')] and got["finish"] == "tool_calls"
    assert same_but_ids(reassemble(chunks), got)
    assert json.loads(constraint.json) == WEATHER_PARAMETERS


@async_test
async def test_required_schema_hoists_defs(model, tool_tokenizer):
    with_defs = [
        {
            "type": "function",
            "function": {
                "name": "place",
                "parameters": {
                    "type": "object",
                    "properties": {"where": {"$ref": "#/$defs/City"}},
                    "$defs": {"City": {"type": "string"}},
                },
            },
        }
    ]
    async with serving(model, tool_tokenizer) as h:
        h.engine.replies = [reply(tool_tokenizer, '[{"name":"place","parameters":{"where":"Oslo"}}]')]
        got = summary(await whole(h, tools=with_defs, tool_choice="required"))
        schema = json.loads(h.engine.requests[0].sampling.structured_outputs.json)
    assert schema["$defs"] == {"City": {"type": "string"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert got["calls"] == [("place", '{"where":"Oslo"}')]


# ------------------------------------------------------------------------------------------ 400s

BAD = [
    ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),  # "auto" by default, without the flags
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "`tools`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "Invalid"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Invalid"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "response_format",
    ),
    (
        {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "structured_outputs": {"regex": "a+"},
        },
        "tool_choice",
        "structured_outputs",
    ),
    ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools[0].function", None),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", None),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        "tools[0].function.parameters",
        None,
    ),
    (
        {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": "maybe",
        },
        "parallel_tool_calls",
        None,
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tool_choice": "required",
        },
        "tools",
        None,
    ),
    (
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}
                    ],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
        None,
    ),
    (
        {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1"}]}]},
        "messages[1].tool_calls[0].function",
        None,
    ),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
]


@async_test
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(model, tool_tokenizer):
    async with serving(model, tool_tokenizer) as h:
        for fields, param, words in BAD:
            status, answer, _ = await h.post("/v1/chat/completions", body(**fields))
            assert_error(status, answer, 400, "BadRequestError", param)
            assert words is None or words in answer["error"]["message"], (fields, answer)
        assert h.engine.requests == []
        # what vLLM accepts: "required" with no tools is "none"; "none" with tools renders them
        for fields in (
            {"tools": [], "tool_choice": "required"},
            {"tools": TOOLS, "tool_choice": "none"},
            {"tool_choice": "none"},
            {"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": True},
        ):
            await whole(h, **fields)
        assert all(r.sampling.structured_outputs is None for r in h.engine.requests)


# ------------------------------------------------------------------------------------------ multi-turn


@async_test
async def test_assistant_tool_calls_and_tool_results_round_trip_through_the_template(model, tool_tokenizer):
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "chatcmpl-tool-2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "Sunny, 25C"},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-2", "content": "12:00"},
    ]
    async with serving(model, tool_tokenizer, **AUTO) as h:
        h.engine.replies = [reply(tool_tokenizer, "Sunny and noon.")]
        got = summary(await whole(h, tools=TOOLS, messages=conversation))
        prompt = tool_tokenizer.decode(h.engine.requests[0].prompt_token_ids)
    assert got["content"] == "Sunny and noon." and got["calls"] == []
    # the arguments strings were parsed into objects, so the template's tojson renders them as JSON, not strings
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '{"name": "get_time", "arguments": {}}' in prompt
    assert "<tool_response>\nSunny, 25C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>" in prompt


# ------------------------------------------------------------------------------------------ reasoning


@async_test
async def test_reasoning_content_whole_and_streamed(model, tool_tokenizer):
    thought = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
    async with serving(model, tool_tokenizer, reasoning_parser="qwen3") as h:
        h.engine.replies = [
            reply(tool_tokenizer, thought),
            reply(tool_tokenizer, thought),
            reply(tool_tokenizer, "No thoughts."),
        ]
        got = summary(await whole(h))
        chunks = await streamed(h)
        plain = summary(await whole(h))
    assert got["reasoning"] == "\nThe user wants weather.\n" and got["content"] == "\n\nIt is sunny."
    assert same_but_ids(reassemble(chunks), got)
    assert any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    assert plain["reasoning"] is None and plain["content"] == "No thoughts."


@async_test
async def test_tool_calls_are_read_after_the_reasoning(model, tool_tokenizer):
    output = (
        "<think>\nI could write <tool_call> here and it is still thinking.\n</think>\n\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    async with serving(model, tool_tokenizer, reasoning_parser="qwen3", **AUTO) as h:
        h.engine.replies = [reply(tool_tokenizer, output), reply(tool_tokenizer, output)]
        got = summary(await whole(h, tools=TOOLS))
        chunks = await streamed(h, tools=TOOLS)
    assert got["reasoning"] == "\nI could write <tool_call> here and it is still thinking.\n"
    assert got["calls"] == [("get_time", "{}")] and got["content"] == "\n\n" and got["finish"] == "tool_calls"
    assert same_but_ids(reassemble(chunks), got)


@async_test
async def test_structured_outputs_begin_after_thinking_unless_it_is_off(model, tool_tokenizer):
    named = {"type": "function", "function": {"name": "get_weather"}}
    end_ids = end_marker_ids(get_reasoning_parser("deepseek_r1"), tool_tokenizer)
    async with serving(model, tool_tokenizer, reasoning_parser="deepseek_r1") as h:
        h.engine.replies = [
            reply(tool_tokenizer, 'Paris it is.</think>{"city":"Paris"}'),
            reply(tool_tokenizer, '{"city":"Paris"}'),
            reply(tool_tokenizer, "{}"),
        ]
        thinking = summary(await whole(h, tools=TOOLS, tool_choice=named))
        off = summary(await whole(h, tools=TOOLS, tool_choice=named, chat_template_kwargs={"enable_thinking": False}))
        await whole(h, response_format={"type": "json_object"})
        prompt = tool_tokenizer.decode(h.engine.requests[1].prompt_token_ids)
    first, second, third = (r.sampling.structured_outputs for r in h.engine.requests)
    assert first.begin_after_token_ids == end_ids and end_ids
    assert second.begin_after_token_ids is None and prompt.endswith("<think>\n\n</think>\n\n")
    assert third.json_object and third.begin_after_token_ids == end_ids  # any constraint waits for the thinking
    assert thinking["reasoning"] == "Paris it is." and thinking["calls"] == [("get_weather", '{"city":"Paris"}')]
    assert off["reasoning"] is None and off["calls"] == [("get_weather", '{"city":"Paris"}')]
