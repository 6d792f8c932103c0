"""Inputs that once reached a 500 (issue 28): each is a 400 naming the field, and the server keeps serving."""

from __future__ import annotations

from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving

HI = [{"role": "user", "content": "Hi"}]
DEEP_ARGUMENTS = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit when parsed
# integers a structural tag's schema compiles with but msgpack cannot carry to the engine (-2**63 .. 2**64 - 1)
HUGE_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "default": 2**65}}}


def structural_tag(schema: dict) -> dict:
    return {"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}]}


HOSTILE = [
    (
        "/v1/responses",
        {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_ARGUMENTS}]},
        "input[0].arguments",
    ),
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "structural_tag",
                "triggers": ["<f"],
                "structures": [{"begin": 5, "schema": {"type": "object"}, "end": "</f>"}],
            }
        },
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {
            "structured_outputs": {
                "structural_tag": {
                    "triggers": ["<f"],
                    "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": ["</f>"]}],
                }
            }
        },
        "structured_outputs",
    ),
    (
        "/v1/chat/completions",
        {"structured_outputs": {"structural_tag": structural_tag(HUGE_SCHEMA)}},
        "structured_outputs",
    ),
    (
        "/v1/completions",
        {"response_format": {"type": "structural_tag", **structural_tag({"type": "integer", "maximum": -(2**64)})}},
        "response_format",
    ),
    ("/v1/chat/completions", {"structured_outputs": {"json": HUGE_SCHEMA}}, "structured_outputs"),
    (
        "/v1/responses",
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": HUGE_SCHEMA}}},
        "text.format.schema",
    ),
]


def body_for(path: str, fields: dict) -> dict:
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}
    if path == "/v1/responses":
        return {"model": MODEL, "input": "Hello", "max_output_tokens": 2, **fields}
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


@async_test
async def test_former_500s_are_400s_naming_the_field(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        for path, fields, param in HOSTILE:
            status, body, _ = await h.post(path, body_for(path, fields))
            assert_error(status, body, 400, "BadRequestError", param)
        assert h.engine.requests == []
        await h.good_completion()
