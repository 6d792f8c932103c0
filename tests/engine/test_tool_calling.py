"""Tool calling against real servers, through the official `openai` client and LangChain's `ChatOpenAI`.

A tiny random-weight Qwen2-architecture checkpoint whose tokenizer_config.json carries a Qwen2.5-style (Hermes)
tool template is served with `--tool-call-parser hermes --enable-auto-tool-choice`; the shipped default model is
served with no tool flags. Random weights never call a tool of their own accord, so the calls come from a forced
tool_choice ("required" or a named function), which structured outputs enforce: their arguments must validate against
the function's schema whatever the weights. A call then goes back as an assistant message with its tool result, and
the next turn renders (the call and the result are in the prompt) and answers. Streamed calls reassemble into the
same call as the whole response (greedy, one request at a time, so the outputs are identical).
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
import requests

from tests.helpers.chat_templates import HERMES_TOOL_TEMPLATE
from tests.helpers.server import Server

pytestmark = pytest.mark.slow

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME_PARAMETERS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
ASK = [
    {"role": "system", "content": "You are a weather assistant. Use the tools."},
    {"role": "user", "content": "What is the weather in Paris for the next two days?"},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def tool_model(tiny_checkpoints, tmp_path_factory):
    """The tiny qwen2 checkpoint, copied, with the tool template in its tokenizer_config.json."""
    path = tmp_path_factory.mktemp("tool-model") / "qwen2-tools"
    shutil.copytree(tiny_checkpoints("qwen2"), path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = HERMES_TOOL_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny_server(tool_model, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("tool-calling") / "tiny.log"
    with Server(
        str(tool_model),
        "--served-model-name",
        "tiny",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        "64MiB",
        log_path=log_path,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def tiny(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0, timeout=300)


def ask(client: openai.OpenAI, model: str, messages=ASK, **fields):
    return client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, **{"temperature": 0, "max_tokens": MAX_TOKENS, **fields}
    )


def valid_calls(message) -> list[tuple[str, dict]]:
    """The message's calls, each one's arguments validated against its function's schema."""
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-"), call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def streamed_calls(client: openai.OpenAI, model: str, **fields) -> tuple[list[tuple[str, str]], str]:
    """The calls a streamed response reassembles into (name, arguments text), and its finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in ask(client, model, stream=True, **fields):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.function.name, call
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))], finish


def check_forced_calls(client: openai.OpenAI, model: str) -> list:
    """Named and required tool_choice: schema-valid calls, "tool_calls" finish, the same calls streamed."""
    named = ask(client, model, tool_choice=NAMED)
    required = ask(client, model, tool_choice="required", parallel_tool_calls=False)
    for response, names in ((named, ["get_weather"]), (required, None)):
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = valid_calls(choice.message)
        assert len(calls) == 1 and (names is None or [n for n, _ in calls] == names), calls
    for response, fields in (
        (named, {"tool_choice": NAMED}),
        (required, {"tool_choice": "required", "parallel_tool_calls": False}),
    ):
        calls, finish = streamed_calls(client, model, **fields)
        whole = [(c.function.name, c.function.arguments) for c in response.choices[0].message.tool_calls]
        assert (calls, finish) == (whole, "tool_calls")
    return [named, required]


def test_forced_tool_calls_validate_and_stream_the_same(tiny):
    check_forced_calls(tiny, "tiny")


def test_tool_call_round_trip_renders_and_answers(tiny, tiny_server):
    response = ask(tiny, "tiny", tool_choice=NAMED)
    message = response.choices[0].message
    ((name, arguments),) = valid_calls(message)
    conversation = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny, 25C"},
    ]
    answer = ask(tiny, "tiny", messages=conversation)  # tool_choice "auto": the hermes parser reads the output
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    assert choice.message.tool_calls is None  # random weights do not call tools on their own
    tokens = requests.post(
        f"{tiny_server.url}/tokenize", json={"messages": conversation, "tools": TOOLS}, timeout=30
    ).json()["tokens"]
    prompt = requests.post(f"{tiny_server.url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>' in prompt
    assert "<tool_response>\nSunny, 25C\n</tool_response>" in prompt and '"name": "get_time"' in prompt


def test_langchain_bind_tools_round_trip(tiny_server):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{tiny_server.url}/v1",
        api_key="none",
        model="tiny",
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=300,
    )
    messages = [SystemMessage(ASK[0]["content"]), HumanMessage(ASK[1]["content"])]
    for tool_choice in ("get_weather", "required"):
        bound = llm.bind_tools(TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
        reply = bound.invoke(messages)
        assert len(reply.tool_calls) == 1 and reply.response_metadata["finish_reason"] == "tool_calls", reply
        call = reply.tool_calls[0]
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
        streamed = None
        for chunk in bound.stream(messages):
            streamed = chunk if streamed is None else streamed + chunk
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
        answer = llm.bind_tools(TOOLS).invoke([*messages, reply, ToolMessage("Sunny, 25C", tool_call_id=call["id"])])
        assert isinstance(answer.content, str) and answer.tool_calls == []


def test_auto_flags_are_needed_on_the_default_model(tmp_path_factory):
    """The shipped default model with no tool flags: forced tool_choice works (structured outputs), "auto" is a 400
    naming tool_choice, as vLLM answers it."""
    log_path = tmp_path_factory.mktemp("tool-calling-default") / "default.log"
    with Server("--max-model-len", "2048", "--kv-cache-memory-bytes", "128MiB", log_path=log_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        check_forced_calls(client, model)
        with pytest.raises(openai.BadRequestError) as caught:
            ask(client, model)
        assert caught.value.param == "tool_choice" and "--enable-auto-tool-choice" in caught.value.message
        plain = ask(client, model, tool_choice="none", max_tokens=8).choices[0]
        assert plain.message.tool_calls is None and plain.message.content
