"""POST /v1/responses against a real server (SmolLM2 on CPU), every answer parsed by the official `openai` client:
`responses.create` with a string and with message items (greedy, so each must say what the same chat completion
says), `max_output_tokens` ending in an incomplete response, the typed event stream, the stream helper's
`get_final_response()` over a tool round trip given as function_call / function_call_output items, a
`text.format` JSON schema whose output validates with `jsonschema`, and function calls: forced (a named function,
"required") and parsed by the hermes parser under tool_choice "auto". The requests go out at once (CPU steps are
slow).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers.api_helpers import API_KEY, result, run_concurrently, strictly_valid
from tests.helpers.server import Server

pytestmark = pytest.mark.slow

NEW_TOKENS = 6
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the tallest mountain in the world?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
ITEMS = [
    {"type": "message", "role": "system", "content": SYSTEM},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TOOL_CHAT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25C"},
]
TOOL_ITEMS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 25C"},
]
TOOL_TOKENS = 10  # the model ends this answer with EOS before (tests/engine/test_api_openai.py)
HERMES_CALL = r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}"\}\}</tool_call>'
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("api-responses") / "server.log"
    with Server(
        "--api-key",
        API_KEY,
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        "128MiB",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        log_path=log_path,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def answers(server) -> dict:
    model = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0).models.list().data[0].id

    async def events(stream) -> list:
        return [event async for event in await stream]

    async def helper(c: openai.AsyncOpenAI, **kwargs) -> tuple[list, object]:
        async with c.responses.stream(model=model, temperature=0, **kwargs) as stream:
            seen = [event async for event in stream]
            return seen, await stream.get_final_response()

    def build(c: openai.AsyncOpenAI) -> dict:
        greedy = dict(model=model, temperature=0)
        nested_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
        return {
            "chat": c.chat.completions.create(messages=CHAT, max_completion_tokens=NEW_TOKENS, **greedy),
            "string": c.responses.create(input=QUESTION, instructions=SYSTEM, max_output_tokens=NEW_TOKENS, **greedy),
            "items": c.responses.create(input=ITEMS, max_output_tokens=NEW_TOKENS, **greedy),
            "stream": events(
                c.responses.create(
                    input=QUESTION, instructions=SYSTEM, max_output_tokens=NEW_TOKENS, stream=True, **greedy
                )
            ),
            "tool_chat": c.chat.completions.create(
                messages=TOOL_CHAT, tools=[nested_tool], tool_choice="none", max_tokens=TOOL_TOKENS, **greedy
            ),
            "tool_helper": helper(
                c,
                input=TOOL_ITEMS,
                instructions="You are a weather bot.",
                tools=[WEATHER],
                tool_choice="none",
                max_output_tokens=TOOL_TOKENS,
            ),
            # tool_choice "auto": the hermes parser reads the call the model writes (a regex makes SmolLM2 write one)
            "auto": helper(
                c,
                input="Weather in Paris?",
                tools=[WEATHER],
                max_output_tokens=60,
                extra_body={"structured_outputs": {"regex": HERMES_CALL}},
            ),
            "named": c.responses.create(
                input="Weather in Paris?",
                tools=[WEATHER],
                max_output_tokens=40,
                tool_choice={"type": "function", "name": "get_weather"},
                **greedy,
            ),
            "required": events(
                c.responses.create(
                    input="Weather in Paris?",
                    tools=[WEATHER],
                    max_output_tokens=60,
                    tool_choice="required",
                    stream=True,
                    **greedy,
                )
            ),
            "json": c.responses.create(
                input="Pick a city and say whether it is sunny there.",
                instructions="Answer with JSON.",
                max_output_tokens=60,
                **greedy,
                text={"format": {"type": "json_schema", "name": "weather", "schema": CITY_SCHEMA, "strict": True}},
            ),
        }

    return run_concurrently(server.url, build)


def test_string_input_says_what_chat_says(answers):
    chat = result(answers, "chat")
    response = strictly_valid(result(answers, "string"))
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content and response.output_text
    # max_output_tokens cut it short, as max_completion_tokens cut the chat completion
    assert chat.choices[0].finish_reason == "length"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == NEW_TOKENS == response.max_output_tokens
    assert response.instructions == SYSTEM and response.temperature == 0


def test_message_items_render_the_same_conversation(answers):
    string, items = result(answers, "string"), strictly_valid(result(answers, "items"))
    assert items.output_text == string.output_text and items.usage.input_tokens == string.usage.input_tokens


def test_typed_event_stream(answers):
    events = result(answers, "stream")
    whole = result(answers, "string")
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events[4:-4]) == whole.output_text == events[-4].text
    final = strictly_valid(events[-1].response)
    assert final.output_text == whole.output_text and final.usage.output_tokens == NEW_TOKENS
    assert final.output[0].id == events[2].item.id == events[4].item_id


def test_tool_round_trip_items_through_the_stream_helper(answers):
    chat = result(answers, "tool_chat")
    events, final = result(answers, "tool_helper")
    final = strictly_valid(final)
    assert chat.choices[0].finish_reason == "stop"  # the model answered within TOOL_TOKENS
    assert final.status == "completed" and final.output_text == chat.choices[0].message.content
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    # function_call and function_call_output items rendered as the assistant tool call and the tool message
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    assert [t.name for t in final.tools] == ["get_weather"]


def test_text_format_json_schema_output_validates(answers):
    response = strictly_valid(result(answers, "json"))
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), CITY_SCHEMA)
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == CITY_SCHEMA


def test_forced_tool_choice_gives_function_calls(answers):
    """tool_choice naming a function, or "required", constrains the output (structured outputs) to a call."""
    named = strictly_valid(result(answers, "named"))
    [call] = named.output
    assert named.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = result(answers, "required")
    final = strictly_valid(events[-1].response)
    assert events[-1].type == "response.completed" and final.output
    assert all(item.type == "function_call" and item.name == "get_weather" for item in final.output)
    for item in final.output:
        jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
        streamed = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == item.id
        )
        assert streamed == item.arguments


def test_auto_tool_choice_parses_the_models_call(answers):
    events, final = result(answers, "auto")
    final = strictly_valid(final)
    assert final.status == "completed" and [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "Sure."
    call = final.output[1]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments
