"""Structured-output fields in chat and completions: each becomes the engine's StructuredOutputsParams, and each
malformed one is a 400 naming its field before anything reaches the engine."""

from __future__ import annotations

import json

from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tokenmill.messages import StructuredOutputsParams

HI = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

ACCEPTED = [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
        StructuredOutputsParams(json=SCHEMA),
    ),
    ("/v1/chat/completions", {"response_format": {"type": "text"}}, None),
    (
        "/v1/chat/completions",
        {"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
        StructuredOutputsParams(regex="[a-z]+"),
    ),
    ("/v1/completions", {"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutputsParams(choice=["x", "y"])),
    (
        "/v1/completions",
        {"structured_outputs": {"grammar": 'start: "a"+'}},
        StructuredOutputsParams(grammar='start: "a"+'),
    ),
    (
        "/v1/completions",
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
        StructuredOutputsParams(json=json.dumps(SCHEMA)),
    ),
    ("/v1/completions", {"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ("/v1/completions", {"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
    ("/v1/completions", {"guided_choice": ["a"]}, StructuredOutputsParams(choice=["a"])),
    ("/v1/completions", {"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    (
        "/v1/completions",
        {
            "response_format": {
                "type": "structural_tag",
                "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                "triggers": ["<f"],
            }
        },
        StructuredOutputsParams(
            structural_tag={"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f"]}
        ),
    ),
]

REFUSED = [
    ("/v1/chat/completions", {"response_format": "json"}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "object", "required": 5}},
            }
        },
        "response_format",
    ),
    ("/v1/completions", {"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs"),
    (
        "/v1/completions",
        {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
        "structured_outputs.disable_additional_properties",
    ),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ("/v1/completions", {"guided_choice": "a"}, "guided_choice"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    (
        "/v1/completions",
        {
            "response_format": {
                "type": "structural_tag",
                "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                "triggers": ["<g"],
            }
        },
        "response_format",
    ),
]


def body_for(path: str, fields: dict) -> dict:
    base = {"prompt": "Hello", "max_tokens": 2} if path == "/v1/completions" else {"messages": HI, "max_tokens": 2}
    return {"model": MODEL, **base, **fields}


@async_test
async def test_each_field_reaches_the_engine_as_one_constraint(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        for path, fields, expected in ACCEPTED:
            h.engine.requests.clear()
            status, body, _ = await h.post(path, body_for(path, {**fields, "n": 2}))
            assert status == 200, (fields, body)
            assert [r.sampling.structured_outputs for r in h.engine.requests] == [expected, expected], fields


@async_test
async def test_malformed_constraints_are_400s_naming_the_field(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        for path, fields, param in REFUSED:
            status, body, _ = await h.post(path, body_for(path, fields))
            assert_error(status, body, 400, "BadRequestError", param)
        assert h.engine.requests == []


def padded_schema(num_properties: int, description_chars: int) -> dict:
    """A schema whose properties (one of them named `description`) carry long descriptions and titles."""
    names = ["description", *(f"field_{i}" for i in range(num_properties - 1))]
    properties = {
        name: {"type": "string", "maxLength": 8, "description": "d" * description_chars, "title": name}
        for name in names
    }
    return {"type": "object", "title": "t", "properties": properties, "required": names[:2]}


@async_test
async def test_a_schema_reaches_the_engine_without_its_annotations(smollm2_model, tokenizer):
    """2 MB of descriptions are admitted, but never travel to the scheduler nor into a grammar: neither reads them."""
    schema = padded_schema(200, 10_000)
    async with serving(smollm2_model, tokenizer) as h:
        fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", fields))
        assert status == 200, body
        [sent] = [r.sampling.structured_outputs for r in h.engine.requests]
        assert sent is not None and isinstance(sent.json, dict)
        assert set(sent.json) == {"type", "properties", "required"}
        assert sent.json["properties"]["description"] == {"type": "string", "maxLength": 8}  # a name, kept
        assert len(json.dumps(sent.json)) < 10_000

        h.engine.requests.clear()
        fields = {"structured_outputs": {"json": json.dumps(padded_schema(3, 100))}}  # JSON text stays text
        status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", fields))
        assert status == 200, body
        [sent] = [r.sampling.structured_outputs for r in h.engine.requests]
        assert sent is not None and isinstance(sent.json, str) and "ddd" not in sent.json


@async_test
async def test_a_constraint_larger_than_the_limit_is_a_400_naming_its_field(smollm2_model, tokenizer):
    """Property names, enums and patterns are what a grammar is built from: past --max-structured-outputs-bytes, a
    400 naming the field, before anything compiles or reaches the engine."""
    many_names = {"type": "object", "properties": {f"name_{i:05d}_{'x' * 20}": {"type": "string"} for i in range(100)}}
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": many_names}}},
            "response_format",
        ),
        ({"guided_json": many_names}, "guided_json"),
        ({"structured_outputs": {"regex": "(a|b)" * 1000}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["c" * 100] * 60}}, "structured_outputs"),
    ]
    async with serving(smollm2_model, tokenizer, max_structured_outputs_bytes=4096) as h:
        for fields, param in cases:
            status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", fields))
            assert_error(status, body, 400, "BadRequestError", param)
            assert "--max-structured-outputs-bytes" in body["error"]["message"]
        # annotations do not count: the padded schema is far larger than the limit, its constraint is not
        fields = {"guided_json": padded_schema(20, 1_000)}
        status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", fields))
        assert status == 200, body
        assert len(h.engine.requests) == 1


@async_test
async def test_a_regex_repeated_past_the_bound_is_a_400_naming_its_field(smollm2_model, tokenizer):
    """`c{1000000}` passed llguidance's validation and failed only when the scheduler built its automaton: a counted
    repetition (nested counts multiplied) past MAX_REGEX_REPETITION is a 400 at admission, as a regex or a schema's
    pattern; one at the bound is admitted."""
    too_many = "(a|b)*c{1000000}"
    nested = "((c{100}){100}){100}"
    cases = [
        ({"structured_outputs": {"regex": too_many}}, "structured_outputs", "the regex"),
        ({"guided_regex": nested}, "guided_regex", "the regex"),
        (
            {"response_format": json_schema_format(pattern_schema(too_many))},
            "response_format",
            "schema.properties.code.pattern",
        ),
        ({"structured_outputs": {"json": json.dumps(pattern_schema(nested))}}, "structured_outputs", "pattern"),
    ]
    async with serving(smollm2_model, tokenizer) as h:
        for fields, param, where in cases:
            status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", fields))
            assert_error(status, body, 400, "BadRequestError", param)
            assert where in body["error"]["message"] and "10000" in body["error"]["message"], body
        assert h.engine.requests == []
        at_the_bound = [{"structured_outputs": {"regex": "(c{100}){100}"}}, {"guided_json": pattern_schema("c{10000}")}]
        for fields in at_the_bound:
            status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", fields))
            assert status == 200, body
        assert len(h.engine.requests) == 2


def pattern_schema(regex: str) -> dict:
    return {"type": "object", "properties": {"code": {"type": "string", "pattern": regex}}, "required": ["code"]}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@async_test
async def test_a_grammar_repeated_past_the_bound_is_a_400_naming_its_field(smollm2_model, tokenizer):
    """A Lark or GBNF grammar's regex terminals and counts passed llguidance's validation unbounded (as a regex's
    did): past MAX_REGEX_REPETITION copies it is a 400 naming the field; at the bound it is admitted."""
    cases = [
        ({"structured_outputs": {"grammar": "start: /(a|b)*c{1000000}/"}}, "structured_outputs"),
        ({"guided_grammar": "root ::= [a-z]{1000000}"}, "guided_grammar"),
    ]
    async with serving(smollm2_model, tokenizer) as h:
        for fields, param in cases:
            status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", fields))
            assert_error(status, body, 400, "BadRequestError", param)
            assert "the grammar repeats a piece" in body["error"]["message"], body
        assert h.engine.requests == []
        fields = {"structured_outputs": {"grammar": 'start: ("a"{100} "b"){100}'}}
        status, body, _ = await h.post("/v1/completions", body_for("/v1/completions", fields))
        assert status == 200, body
        assert len(h.engine.requests) == 1
