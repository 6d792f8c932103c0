"""Structured outputs against a real server on the default model (SmolLM2), through the official `openai` client.

The acceptance run: 200 random JSON schemas (tests/helpers/json_schemas.py) at temperature 1, every output parsing
and validating with `jsonschema`, then the same 200 streamed, the deltas joined. Plus each other kind of constraint
(regex, choice, Lark and GBNF grammars, json_object, the guided_* aliases, completions), n > 1, and the 400s.
`TOKENMILL_SCHEMA_COUNT` changes the number of schemas.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re

import jsonschema
import openai
import pytest

from tests.helpers.json_schemas import random_schema
from tests.helpers.server import Server

pytestmark = pytest.mark.slow

NUM_SCHEMAS = int(os.environ.get("TOKENMILL_SCHEMA_COUNT", "200"))
MAX_TOKENS = 400
CONCURRENCY = 32
PROMPT = [
    {"role": "system", "content": "You answer with one JSON object and nothing else."},
    {"role": "user", "content": "Invent some data for a small record."},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("structured") / "server.log"
    with Server(
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        "256MiB",
        "--max-num-seqs",
        str(CONCURRENCY),
        log_path=log_path,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}


async def _ask_all(url: str, model: str, schemas: list[dict], stream: bool) -> list[tuple[str, str]]:
    """(text, finish_reason) for each schema, CONCURRENCY requests in flight."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def ask(i: int, schema: dict) -> tuple[str, str]:
        async with gate:
            kwargs = dict(
                model=model,
                messages=PROMPT,
                temperature=1.0,
                max_tokens=MAX_TOKENS,
                seed=i,
                response_format=schema_format(schema),
            )
            if not stream:
                response = await client.chat.completions.create(**kwargs)
                return response.choices[0].message.content, response.choices[0].finish_reason
            parts, finish = [], None
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    parts.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
            return "".join(parts), finish

    try:
        return await asyncio.gather(*(ask(i, s) for i, s in enumerate(schemas)))
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_random_json_schemas_give_valid_json_at_temperature_1(server, model, stream):
    schemas = [random_schema(random.Random(1000 + i)) for i in range(NUM_SCHEMAS)]
    answers = asyncio.run(_ask_all(server.url, model, schemas, stream))
    failures = []
    for i, (schema, (text, finish)) in enumerate(zip(schemas, answers)):
        try:
            jsonschema.validate(json.loads(text), schema)
            assert finish == "stop", finish
        except (ValueError, AssertionError, jsonschema.ValidationError) as exc:
            failures.append(f"schema {i}: {type(exc).__name__}: {exc}\n  {json.dumps(schema)}\n  -> {text!r}")
    assert not failures, f"{len(failures)}/{len(schemas)} outputs invalid:\n" + "\n".join(failures[:5])


def test_each_kind_of_constraint(client, model):
    def chat(**extra) -> list[str]:
        response = client.chat.completions.create(
            model=model, messages=PROMPT, temperature=1.0, max_tokens=60, seed=3, **extra
        )
        assert all(c.finish_reason == "stop" for c in response.choices), "cut off: the constraint was not completed"
        return [c.message.content for c in response.choices]

    regex = r"[A-Z][a-z]{2,6} [0-9]{2}"
    assert re.fullmatch(regex, chat(extra_body={"structured_outputs": {"regex": regex}})[0])
    assert re.fullmatch(regex, chat(extra_body={"guided_regex": regex})[0])
    choices = ["yes", "no", "maybe later"]
    picked = chat(n=3, extra_body={"structured_outputs": {"choice": choices}})
    assert len(picked) == 3 and all(text in choices for text in picked)
    assert chat(extra_body={"guided_choice": choices})[0] in choices
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", chat(extra_body={"structured_outputs": {"grammar": lark}})[0])
    gbnf = 'root ::= "color: " ("red" | "green" | "blue")'
    assert chat(extra_body={"guided_grammar": gbnf})[0] in ("color: red", "color: green", "color: blue")
    # free-form JSON at temperature 1 can fill any max_tokens inside one string: greedy, asked for a short object;
    # greedy alone can loop inside a number for ever too (on an AVX2 host, whose kernels round differently from
    # AVX-512's: {"answer":{", 2},":20180221 20180221 ...), so repeats are penalised (the closing brace never is)
    short = client.chat.completions.create(
        model=model,
        temperature=0,
        frequency_penalty=1.0,
        max_tokens=100,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with a JSON object like {"answer": 4}: what is 2 + 2?'}],
    )
    assert short.choices[0].finish_reason == "stop", short.choices[0].message.content
    assert isinstance(json.loads(short.choices[0].message.content), dict)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    assert 1 <= json.loads(chat(extra_body={"guided_json": schema})[0])["n"] <= 9

    completion = client.completions.create(
        model=model,
        prompt="Answer in JSON:",
        max_tokens=60,
        temperature=1.0,
        n=2,
        seed=5,
        extra_body={"structured_outputs": {"json": schema}},
    )
    for choice in completion.choices:
        jsonschema.validate(json.loads(choice.text), schema)
        assert choice.finish_reason == "stop"


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "object"}, "backend": "xgrammar"}}, "structured_outputs.backend"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
    ],
)
def test_invalid_constraints_are_400s_naming_the_field(client, model, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=PROMPT, max_tokens=5, extra_body=body)
    error = info.value.body
    assert error["param"] == param, error
    assert error["type"] == "BadRequestError"
    # the server is still serving, with nothing left behind
    ok = client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=3, extra_body={"guided_choice": ["fine"]}
    )
    assert ok.choices[0].message.content == "fine"
