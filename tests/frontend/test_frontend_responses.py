"""POST /v1/responses against a fake engine: the response object, the typed event stream (parsed by the official
`openai` client and its stream helper), input items rendered as the chat conversation they stand for, text.format
as a structured-outputs constraint, and a 400 naming the field for everything tokenmill cannot honour."""

from __future__ import annotations

import asyncio
import copy
import json

import openai
import pytest
from openai.types.responses import Response

from tests.helpers.frontend_fakes import EOS_ID
from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tokenmill.frontend.tokenizer import encode_text

REPLY = "Hello there! 😀 Naïve café."
# renders tools, tool calls and tool results, so that the prompt shows how input items became chat messages
TOOL_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t['function'] | tojson }}]{% endfor %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}[call {{ c['id'] }} {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}]{% endfor %}"
    "{% if m.get('tool_call_id') %}[result of {{ m['tool_call_id'] }}]{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


def with_template(tokenizer, template: str):
    custom = copy.copy(tokenizer)
    custom.chat_template = template
    return custom


def strictly_valid(response: Response) -> Response:
    """Validated in full by the `openai` type (the client itself builds its models leniently)."""
    return Response.model_validate(response.to_dict())


def prompt_text(h, tokenizer, index: int = 0) -> str:
    return tokenizer.decode(h.engine.requests[index].prompt_token_ids, skip_special_tokens=False)


def sse_events(body: str) -> list[tuple[str, dict]]:
    """(event name, data) of every event, checking each is `event: <type>` then its `data:` line."""
    events = []
    for block in body.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[len("data: ") :])
        assert data["type"] == name_line[len("event: ") :]
        events.append((data["type"], data))
    return events


# ------------------------------------------------------------------------------------------ the response object


@async_test
async def test_string_input_with_instructions(smollm2_model, tokenizer):
    reply = tokenizer.encode(REPLY) + [EOS_ID]
    expected_prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [reply]
        resp = await h.client.responses.create(
            model=MODEL,
            input="Say hi",
            instructions="Be brief.",
            max_output_tokens=50,
            temperature=0.0,
            top_p=0.5,
            metadata={"trace": "t-1"},
            user="u-7",
            store=True,
            extra_body={"top_k": 5},
        )
    resp = strictly_valid(resp)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    assert resp.output_text == REPLY
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_")
    assert [(p.type, p.text, p.annotations) for p in message.content] == [("output_text", REPLY, [])]
    request = h.engine.requests[0]
    assert request.prompt_token_ids == encode_text(tokenizer, expected_prompt, add_special_tokens=False)
    params = request.sampling
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (50, 0.0, 0.5, 5)
    assert params.structured_outputs is None and params.logprobs is None
    usage = resp.usage
    assert (usage.input_tokens, usage.output_tokens) == (len(request.prompt_token_ids), len(reply))
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    # the request's fields, echoed as OpenAI echoes them; nothing is stored, whatever `store` asked
    assert (resp.instructions, resp.max_output_tokens, resp.temperature, resp.top_p) == ("Be brief.", 50, 0.0, 0.5)
    assert (resp.metadata, resp.user, resp.tool_choice, resp.tools) == ({"trace": "t-1"}, "u-7", "auto", [])
    assert resp.parallel_tool_calls is True and resp.text.format.type == "text" and resp.truncation == "disabled"
    assert resp.model_extra["store"] is False and resp.background is False


@async_test
async def test_max_output_tokens_makes_an_incomplete_response(smollm2_model, tokenizer):
    reply = tokenizer.encode("one two three four five six")
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [reply]
        resp = strictly_valid(await h.client.responses.create(model=MODEL, input="Count", max_output_tokens=3))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == tokenizer.decode(reply[:3]) and resp.output[0].status == "incomplete"
    assert resp.usage.output_tokens == 3 and resp.max_output_tokens == 3


@async_test
async def test_input_items_render_as_the_chat_conversation(smollm2_model, tokenizer):
    """Message items of every role, text parts, and a tool round trip (function_call joins the assistant message
    before it, function_call_output is a tool message); tools in the flat shape reach the template nested."""
    items = [
        {"role": "developer", "content": "Use tools."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "in Paris?"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            "status": "completed",
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Rain"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
    ]
    custom = with_template(tokenizer, TOOL_TEMPLATE)
    async with serving(smollm2_model, custom) as h:
        resp = await h.client.responses.create(
            model=MODEL,
            input=items,
            instructions="Be a weather bot.",
            tools=[WEATHER_TOOL],
            tool_choice="none",
            max_output_tokens=2,
        )
        # a function call with no assistant message before it is an assistant message of its own
        await h.client.responses.create(model=MODEL, input=[items[1], items[3], items[5]], max_output_tokens=2)
    nested = {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_TOOL["parameters"]}
    assert prompt_text(h, custom) == (
        f"[tool {json.dumps(nested)}]<system>Be a weather bot.<developer>Use tools.<user>Weather\nin Paris?"
        f'<assistant>Checking.[call call_1 get_weather {{"city": "Paris"}}][call call_2 get_weather '
        f'{{"city": "Lyon"}}]<tool>Sunny[result of call_1]<tool>Rain[result of call_2]<assistant>'
    )
    assert prompt_text(h, custom, 1) == (
        "<user>Weather\nin Paris?<assistant>[call call_1 get_weather "
        '{"city": "Paris"}]<tool>Sunny[result of call_1]<assistant>'
    )
    assert strictly_valid(resp).tools[0].name == "get_weather" and resp.tools[0].strict is True


@async_test
async def test_a_partial_assistant_message_last_is_continued(smollm2_model, tokenizer):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    items = [
        messages[0],
        {
            "type": "message",
            "role": "assistant",
            "status": "incomplete",
            "content": [{"type": "output_text", "text": "The color is"}],
        },
    ]
    async with serving(smollm2_model, tokenizer) as h:
        await h.client.responses.create(model=MODEL, input=items, max_output_tokens=2)
    expected = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert h.engine.requests[0].prompt_token_ids == encode_text(tokenizer, expected, add_special_tokens=False)


@async_test
async def test_output_logprobs_when_included(smollm2_model, tokenizer):
    reply = tokenizer.encode("Sure thing") + [EOS_ID]
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [reply]
        resp = strictly_valid(
            await h.client.responses.create(
                model=MODEL, input="ok?", include=["message.output_text.logprobs"], top_logprobs=2
            )
        )
    assert h.engine.requests[0].sampling.logprobs == 2
    logprobs = resp.output[0].content[0].logprobs
    assert [e.token for e in logprobs] == [tokenizer.decode([t]) for t in reply]  # EOS listed last, as in chat
    assert all(e.logprob == -0.25 and len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in logprobs)
    assert logprobs[0].top_logprobs[1].token == tokenizer.decode([reply[0] + 1]) and resp.top_logprobs == 2


# ------------------------------------------------------------------------------------------ text.format


@async_test
async def test_text_format_becomes_a_structured_outputs_constraint(smollm2_model, tokenizer):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    json_schema = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    async with serving(smollm2_model, tokenizer) as h:
        resp = await h.client.responses.create(
            model=MODEL, input="Who?", max_output_tokens=2, text={"format": json_schema}
        )
        await h.client.responses.create(
            model=MODEL, input="Any JSON", max_output_tokens=2, text={"format": {"type": "json_object"}}
        )
        await h.client.responses.create(
            model=MODEL, input="Plain", max_output_tokens=2, text={"format": {"type": "text"}, "verbosity": "medium"}
        )
    constraints = [r.sampling.structured_outputs for r in h.engine.requests]
    assert constraints[0].json == schema and constraints[1].json_object is True and constraints[2] is None
    echoed = strictly_valid(resp).text.format
    assert (echoed.type, echoed.name, echoed.schema_, echoed.strict) == ("json_schema", "person", schema, True)


@async_test
async def test_vllm_structured_outputs_field(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        await h.client.responses.create(
            model=MODEL,
            input="Yes or no",
            max_output_tokens=2,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
    assert h.engine.requests[0].sampling.structured_outputs.choice == ["yes", "no"]


# ------------------------------------------------------------------------------------------ streaming


@async_test
async def test_stream_event_sequence(smollm2_model, tokenizer):
    reply = tokenizer.encode(REPLY) + [EOS_ID]
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [reply]
        async with h.http.post(
            h.url("/v1/responses"),
            json={"model": MODEL, "input": "Hi", "stream": True, "include": ["message.output_text.logprobs"]},
        ) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
            events = sse_events((await resp.read()).decode())
    types = [t for t, _ in events]
    num_deltas = types.count("response.output_text.delta")
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    data = dict(events)
    assert data["response.created"]["response"]["status"] == "in_progress"
    assert data["response.created"]["response"]["output"] == []
    item_id = data["response.output_item.added"]["item"]["id"]
    deltas = [d for t, d in events if t == "response.output_text.delta"]
    assert all((d["item_id"], d["output_index"], d["content_index"]) == (item_id, 0, 0) for d in deltas)
    assert "".join(d["delta"] for d in deltas) == REPLY == data["response.output_text.done"]["text"]
    assert "\ufffd" not in "".join(d["delta"] for d in deltas)
    assert sum(len(d["logprobs"]) for d in deltas) == len(reply) - 1  # the EOS token has no text delta
    assert len(data["response.output_text.done"]["logprobs"]) == len(reply)
    final = Response.model_validate(data["response.completed"]["response"])
    assert final.status == "completed" and final.output_text == REPLY and final.output[0].id == item_id
    assert final.usage.output_tokens == len(reply)
    assert data["response.output_item.done"]["item"] == final.output[0].model_dump(exclude_unset=True)


@async_test
async def test_stream_through_the_openai_client_and_its_helper(smollm2_model, tokenizer):
    reply = tokenizer.encode(REPLY) + [EOS_ID]
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.replies = [list(reply), list(reply), tokenizer.encode("a b c d e f")]
        stream = await h.client.responses.create(model=MODEL, input="Hi", stream=True)
        events = [event async for event in stream]
        async with h.client.responses.stream(model=MODEL, input="Hi") as helper:
            text = "".join([event.delta async for event in helper if event.type == "response.output_text.delta"])
            final = await helper.get_final_response()
        short = [
            event
            async for event in await h.client.responses.create(
                model=MODEL, input="Hi", stream=True, max_output_tokens=2
            )
        ]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    assert strictly_valid(events[-1].response).output_text == REPLY
    assert text == REPLY and final.output_text == REPLY and final.status == "completed"
    assert short[-1].type == "response.incomplete" and short[-1].response.status == "incomplete"
    assert short[-1].response.incomplete_details.reason == "max_output_tokens"
    assert short[-2].type == "response.output_item.done" and short[-2].item.status == "incomplete"


@async_test
async def test_engine_dying_mid_stream_is_an_error_event(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.step_delay_s = 0.01
        async with h.http.post(
            h.url("/v1/responses"), json={"model": MODEL, "input": "a b c d e f g h", "stream": True}
        ) as resp:
            assert resp.status == 200
            first = await resp.content.readline()
            h.engine.dead_reason = "scheduler died"
            events = sse_events((first + await resp.read()).decode())
    kind, error = events[-1]
    assert kind == "error" and error["code"] == "503" and "scheduler died" in error["message"]
    assert "response.completed" not in [t for t, _ in events]
    assert [data["sequence_number"] for _, data in events][-1] == len(events) - 1


@async_test
async def test_engine_rejection_is_a_plain_400_even_when_streaming(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.reject_with = "prompt has a token the model cannot take"
        for stream in (False, True):
            status, error, _ = await h.post("/v1/responses", {"model": MODEL, "input": "x", "stream": stream})
            assert_error(status, error, 400, "BadRequestError")
            assert error["error"]["message"] == "prompt has a token the model cannot take"


@async_test
async def test_disconnect_mid_stream_aborts(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.hold = True
        resp = await h.http.post(h.url("/v1/responses"), json={"model": MODEL, "input": "hi", "stream": True})
        assert resp.status == 200 and (await resp.content.readline()) == b"event: response.created\n"
        resp.close()
        await asyncio.wait_for(h.engine.aborted_event.wait(), 5)
        assert h.engine.aborted == [h.engine.requests[0].request_id]


# ------------------------------------------------------------------------------------------ refusals


@async_test
async def test_what_tokenmill_cannot_honour_is_a_400_naming_the_field(smollm2_model, tokenizer):
    ok = {"model": MODEL, "input": "x", "max_output_tokens": 2}
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
    cases = [
        ({"background": True}, "background"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"truncation": "auto"}, "truncation"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
        ({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include[1]"),
        ({"tools": [WEATHER_TOOL, {"type": "web_search"}]}, "tools[1].type"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER_TOOL]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "file_search"}, "tools": [WEATHER_TOOL]}, "tool_choice.type"),
        ({"input": [image]}, "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input[0].encrypted_content"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}},
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"max_output_tokens": 1000}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"input": " ".join(["word"] * 300)}, "input"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"a": [[[[[[[[1]]]]]]]]}}]}, "tools"),
    ]
    async with serving(smollm2_model, tokenizer, max_json_depth=8) as h:
        for fields, param in cases:
            status, error, _ = await h.post("/v1/responses", {**ok, **fields})
            assert_error(status, error, 400, "BadRequestError", param)
        status, error, _ = await h.post("/v1/responses", {"model": MODEL})
        assert_error(status, error, 400, "BadRequestError", "input")
        with pytest.raises(openai.NotFoundError):
            await h.client.responses.create(model="gpt-17", input="x")
        assert h.engine.requests == []
        # what OpenAI sends as no-op values is accepted
        resp = await h.client.responses.create(
            model=MODEL,
            input="x",
            max_output_tokens=2,
            reasoning={"effort": None},
            truncation="disabled",
            service_tier="auto",
            include=[],
            tool_choice="none",
            tools=[WEATHER_TOOL],
            parallel_tool_calls=False,
            stream_options=None,
            background=False,
            store=False,
            prompt_cache_key="k",
            safety_identifier="s",
        )
        assert resp.status == "incomplete" and resp.parallel_tool_calls is False


@async_test
async def test_stored_responses_do_not_exist(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        for method, path in [
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"),
            ("POST", "/v1/responses/resp_1/cancel"),
            ("GET", "/v1/responses/resp_1/input_items"),
        ]:
            async with h.http.request(method, h.url(path)) as resp:
                assert_error(resp.status, await resp.json(), 404, "NotFoundError", "response_id")
        with pytest.raises(openai.NotFoundError) as info:
            await h.client.responses.retrieve("resp_1")
        assert "does not store responses" in info.value.message


# ------------------------------------------------------------------------------------------ tools and reasoning

TOOL_FLAGS = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
CALL_TEXT = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def function_calls(response: Response) -> list[tuple[str, str, str]]:
    return [(item.name, item.arguments, item.status) for item in response.output if item.type == "function_call"]


@async_test
async def test_auto_tool_calls_become_function_call_items(smollm2_model, tokenizer):
    reply = tokenizer.encode(CALL_TEXT) + [EOS_ID]
    async with serving(smollm2_model, tokenizer, **TOOL_FLAGS) as h:
        h.engine.replies = [list(reply), list(reply)]
        whole = strictly_valid(
            await h.client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL])
        )
        async with h.client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL]) as s:
            events = [event async for event in s]
            streamed = strictly_valid(await s.get_final_response())
    for response in (whole, streamed):
        assert response.status == "completed" and [item.type for item in response.output] == [
            "message",
            "function_call",
        ]
        assert response.output_text == "Let me check."
        assert function_calls(response) == [("get_weather", '{"city": "Paris"}', "completed")]
        call = response.output[1]
        assert call.id.startswith("fc_") and call.call_id.startswith("chatcmpl-tool-")
    types = [e.type for e in events]
    call_index = types.index("response.output_item.added", types.index("response.output_item.done"))
    assert types[call_index - 1] == "response.output_item.done"  # the message is closed before the call opens
    assert events[call_index].item.type == "function_call" and events[call_index].item.arguments == ""
    arguments = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(e.delta for e in arguments) == '{"city": "Paris"}'
    assert all((e.item_id, e.output_index) == (streamed.output[1].id, 1) for e in arguments)
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == '{"city": "Paris"}' and types[-2:] == ["response.output_item.done", "response.completed"]


@async_test
async def test_forced_tool_choice_is_a_constraint_and_its_output_a_call(smollm2_model, tokenizer):
    other = {**WEATHER_TOOL, "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    async with serving(smollm2_model, tokenizer) as h:  # no tool-call parser is needed for forced calls
        h.engine.replies = [
            tokenizer.encode(
                '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
            )
            + [EOS_ID],
            tokenizer.encode('[{"name": "get_time", "parameters": {}}]') + [EOS_ID],
            tokenizer.encode('{"city": "Lyon"}') + [EOS_ID],
        ]
        required = strictly_valid(
            await h.client.responses.create(model=MODEL, input="x", tools=[WEATHER_TOOL, other], tool_choice="required")
        )
        single = await h.client.responses.create(
            model=MODEL, input="x", tools=[WEATHER_TOOL, other], tool_choice="required", parallel_tool_calls=False
        )
        named = strictly_valid(
            await h.client.responses.create(
                model=MODEL,
                input="x",
                tools=[WEATHER_TOOL, other],
                tool_choice={"type": "function", "name": "get_weather"},
            )
        )
        status, error, _ = await h.post(
            "/v1/responses",
            {
                "model": MODEL,
                "input": "x",
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
        )
        assert_error(status, error, 400, "BadRequestError", "tool_choice")
        status, error, _ = await h.post("/v1/responses", {"model": MODEL, "input": "x", "tools": [WEATHER_TOOL]})
        assert_error(status, error, 400, "BadRequestError", "tool_choice")  # "auto" needs a tool-call parser
        assert "--enable-auto-tool-choice" in error["error"]["message"]
    schemas = [json.loads(r.sampling.structured_outputs.json) for r in h.engine.requests]
    assert schemas[0]["type"] == "array" and schemas[0]["minItems"] == 1 and "maxItems" not in schemas[0]
    assert [v["properties"]["name"]["enum"] for v in schemas[0]["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert schemas[1]["maxItems"] == 1 and schemas[2] == WEATHER_TOOL["parameters"]
    assert function_calls(required) == [
        ("get_weather", '{"city": "Paris"}', "completed"),
        ("get_time", "{}", "completed"),
    ]
    assert required.output_text == "" and function_calls(single) == [("get_time", "{}", "completed")]
    assert function_calls(named) == [("get_weather", '{"city": "Lyon"}', "completed")]


@async_test
async def test_reasoning_becomes_a_reasoning_item(smollm2_model, tokenizer):
    thinking = tokenizer.encode("Two and two.</think>")
    reply = thinking + tokenizer.encode("The answer is 4.") + [EOS_ID]
    async with serving(smollm2_model, tokenizer, reasoning_parser="deepseek_r1") as h:
        h.engine.replies = [list(reply), list(reply)]
        whole = strictly_valid(
            await h.client.responses.create(model=MODEL, input="2+2?", text={"format": {"type": "json_object"}})
        )
        async with h.client.responses.stream(model=MODEL, input="2+2?") as s:
            events = [event async for event in s]
            streamed = strictly_valid(await s.get_final_response())
    assert h.engine.requests[0].sampling.structured_outputs.begin_after_token_ids == tokenizer.encode("</think>")
    for response in (whole, streamed):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        reasoning = response.output[0]
        assert reasoning.id.startswith("rs_") and [c.text for c in reasoning.content] == ["Two and two."]
        assert reasoning.summary == [] and response.output_text == "The answer is 4."
        assert response.usage.output_tokens_details.reasoning_tokens == len(thinking)
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[3].part.type == "reasoning_text"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Two and two."
    assert next(e for e in events if e.type == "response.reasoning_text.done").text == "Two and two."
    assert [e.output_index for e in events if e.type == "response.output_text.delta"] == [1] * types.count(
        "response.output_text.delta"
    )
