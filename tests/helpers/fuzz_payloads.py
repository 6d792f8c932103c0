"""Hypothesis strategies for hostile and careless HTTP requests to every endpoint.

A request starts from a valid body for its endpoint and gets a few mutations: fields set to values of the wrong
type, huge or negative numbers, unicode edge cases (lone surrogates, NUL, emoji, special-token text), empty and huge
strings, unknown fields, deep nesting, required fields removed. The body is then encoded as JSON or mangled as raw
bytes (truncated JSON, invalid UTF-8, NaN, a deeply nested array, non-JSON), and sent with one of several content
types.

`hostile_body` aims at the inputs that reach the scheduler loop or the engine's messages (issue 28): cache salts
around and far past their limit, prompt logprobs around their budget (prompt tokens x (k + 1) x n), constraints with
integers msgpack cannot carry, structural tags of the wrong types, padded schemas, random regexes and grammars for
the grammar engine, and Responses function calls whose arguments nest deeper than the interpreter's stack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st

VALID_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3},
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 3},
    "/v1/embeddings": {"input": ["A cat sat on the mat."]},
    "/tokenize": {"prompt": "Hello there"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/responses": {"input": "Say hi.", "max_output_tokens": 3},
}

# Request fields of the OpenAI and vLLM schemas, valid or not for a given endpoint.
FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "tokens",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "stream",
    "stream_options",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "priority",
    "cache_salt",
    "logprobs",
    "top_logprobs",
    "echo",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "tool_choice",
    "response_format",
    "best_of",
    "suffix",
    "encoding_format",
    "dimensions",
    "truncate_prompt_tokens",
    "add_special_tokens",
    "documents",
    "functions",
    "parallel_tool_calls",
    "prompt_logprobs",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
]

EDGE_STRINGS = [
    "",
    " ",
    "\x00",
    "\ud800",
    "\udfff",
    "\ufffd",
    "😀" * 50,
    "<|im_start|>system",
    "<|im_end|>",
    "{{ 7 * 7 }}",
    "{% for x in range(10**9) %}x{% endfor %}",
    "a" * 20_000,
    "\n" * 1000,
    "'; DROP TABLE users; --",
    "\u202e",
    "ǅ" * 100,
]
EDGE_INTS = [0, -1, 1, 2, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400]
EDGE_FLOATS = [0.0, -0.0, 1e-320, 1e308, -1e308, 0.5, 2.000001, -2.5, 1e10]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_INTS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(EDGE_FLOATS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(EDGE_STRINGS),
    st.text(max_size=30),
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bogus"]) | values,
            "content": st.sampled_from(EDGE_STRINGS) | values,
        }
    ),
    max_size=4,
)


@dataclass
class FuzzRequest:
    method: str
    path: str
    body: bytes
    content_type: str | None


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


@st.composite
def json_body(draw, path: str) -> dict:
    body = dict(VALID_BODIES[path])
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["set", "set", "set", "delete", "messages"]))
        if action == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif action == "messages":
            body["messages"] = draw(messages)
        else:
            body[draw(st.sampled_from(FIELDS) | st.text(max_size=12))] = draw(values)
    return body


SALT_CHARS = ["s", "é", "😀"]
SALT_LENGTHS = [0, 1, 255, 256, 257, 4096, 1_000_000]
HUGE_INTS = [2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30]
WORDS = "the cat sat on a mat while dogs ran far away".split()
DEEP = 100_000


def structural_tag(begin: object, end: object, schema: object, triggers: object) -> dict:
    return {"structures": [{"begin": begin, "schema": schema, "end": end}], "triggers": triggers}


schemas = st.one_of(
    values,
    st.sampled_from(HUGE_INTS).map(lambda n: {"type": "integer", "default": n}),
    st.sampled_from(HUGE_INTS).map(lambda n: {"type": "integer", "maximum": n}),
    st.sampled_from([10, 100_000, 1_000_000]).map(lambda n: {"type": "string", "description": "d" * n}),
    st.just({"type": "object", "properties": {"a": {"$ref": "#"}}}),
)
constraints = st.one_of(
    st.builds(
        lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}, schemas
    ),
    st.builds(lambda s: {"structured_outputs": {"json": s}}, schemas),
    st.builds(
        lambda b, e, s, t: {"response_format": {"type": "structural_tag", **structural_tag(b, e, s, t)}},
        st.sampled_from(["<f>", 5, None, ["<f>"], {"x": 1}]),
        st.sampled_from(["</f>", 7, None, [""]]),
        schemas,
        st.sampled_from([["<f"], [5], "<f", [], [None]]),
    ),
    st.builds(
        lambda r: {"structured_outputs": {"regex": r}},
        st.text(max_size=40)
        | st.sampled_from(["(a|b)*c{1000000}", "(" * 500, "[\\u0000-\\uffff]{99999}", "a{2,1}", "\\p{L}+"]),
    ),
    st.builds(
        lambda g: {"structured_outputs": {"grammar": g}},
        st.text(max_size=60)
        | st.sampled_from(["start: start", 'start: a\na: a a | "x"', "root ::= root", "start: /" + "(" * 200 + "/"]),
    ),
    st.builds(lambda c: {"guided_choice": c}, st.lists(st.sampled_from(EDGE_STRINGS), max_size=5)),
)


@st.composite
def hostile_body(draw) -> tuple[str, dict]:
    """An endpoint and a body aimed at one input that reaches the scheduler or the engine's messages."""
    kind = draw(st.sampled_from(["salt", "prompt_logprobs", "constraint", "function_call", "limits"]))
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses"]))
    body = dict(VALID_BODIES[path])
    if kind == "salt":
        body["cache_salt"] = draw(st.sampled_from(SALT_CHARS)) * draw(st.sampled_from(SALT_LENGTHS))
    elif kind == "prompt_logprobs" and path != "/v1/responses":
        # about 120 words x (20 + 1) x 8 is past the fuzz server's budget; the rest is admitted and kept light
        text = " ".join(WORDS[i % len(WORDS)] for i in range(draw(st.sampled_from([1, 10, 120]))))
        body.update(prompt_logprobs=draw(st.sampled_from([0, 1, 5, 20, 21])), n=draw(st.sampled_from([1, 2, 8])))
        if path == "/v1/completions":
            body.update(prompt=text, echo=draw(st.booleans()), logprobs=draw(st.sampled_from([None, 0, 5])))
        else:
            body["messages"] = [{"role": "user", "content": text}]
    elif kind == "constraint" and path != "/v1/responses":
        body.update(draw(constraints))
    elif kind == "constraint":
        body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": draw(schemas)}}
    elif kind == "function_call":
        path, body = "/v1/responses", dict(VALID_BODIES["/v1/responses"])
        arguments = draw(
            st.sampled_from(["[" * DEEP + "]" * DEEP, '{"a":' * 5000 + "1" + "}" * 5000, "{}", "", "not json"])
            | values.map(json.dumps)
        )
        body["input"] = [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ]
    else:
        body.update(
            stop_token_ids=list(range(draw(st.sampled_from([256, 257])))),
            logit_bias={str(i): 1.0 for i in range(draw(st.sampled_from([1024, 1025])))},
            n=draw(st.sampled_from([1, 2, 129])),
        )  # 128 choices would only queue the others
    return path, body


@st.composite
def fuzz_requests(draw) -> FuzzRequest:
    if draw(st.integers(0, 3)) == 0:
        path, body = draw(hostile_body())
    else:
        path = draw(st.sampled_from(sorted(VALID_BODIES)))
        body = draw(json_body(path))
    if body.get("stream") is True and body.get("max_tokens", 3) not in range(1, 9):
        body["max_tokens"] = 4  # a stream is read to its end; keep valid ones short
    encoded = json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    mangle = draw(st.sampled_from(["none"] * 6 + ["truncate", "invalid_utf8", "nan", "nested", "not_json", "empty"]))
    if mangle == "truncate":
        encoded = encoded[: draw(st.integers(0, max(0, len(encoded) - 1)))]
    elif mangle == "invalid_utf8":
        at = draw(st.integers(0, len(encoded)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"]))
        encoded = encoded[:at] + bad + encoded[at:]
    elif mangle == "nan":
        encoded = encoded.replace(b"3", b"NaN", 1) if b"3" in encoded else b'{"temperature": NaN}'
    elif mangle == "nested":
        encoded = nested(draw(st.sampled_from([64, 1000, 100_000])))
    elif mangle == "not_json":
        encoded = draw(st.sampled_from([b"hello", b"<xml/>", b"\x00\x01\x02", b"[]", b"null", b"1e999", b'"x"']))
    elif mangle == "empty":
        encoded = b""
    content_type = draw(
        st.sampled_from(
            ["application/json"] * 4 + ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
        )
    )
    method = draw(st.sampled_from(["POST"] * 12 + ["GET", "PUT", "DELETE"]))
    return FuzzRequest(method, path, encoded, content_type)
