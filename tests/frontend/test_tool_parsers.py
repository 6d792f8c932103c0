"""The tool-call parsers (tokenmill.frontend.tool_parsers): whole outputs, streamed outputs in any chunking (which must
reassemble into exactly the whole output's result), and malformed outputs (content, as vLLM returns them)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.frontend.tool_parsers import (
    ExtractedToolCalls,
    NamedToolCallParser,
    RequiredToolCallsParser,
    ToolParser,
    fold,
    get_tool_parser,
    random_tool_call_id,
    tool_parser_names,
)
from tokenmill.frontend.tool_parsers.mistral import mistral_tool_call_id


def fixed_id() -> str:
    return "call-id"


def parser(name: str) -> ToolParser:
    return get_tool_parser(name)(make_id=fixed_id)


def chunkings(text: str, rng: random.Random, count: int = 40):
    """The text cut at random places (single characters, large pieces, and the whole text)."""
    yield [text]
    yield list(text)
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream(p: ToolParser, pieces: list[str]):
    return [p.extract_streaming(piece) for piece in pieces] + [p.finish()]


def calls_of(result: ExtractedToolCalls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in result.tool_calls]


def assert_streams_like_whole(make: callable, text: str, seed: int = 0) -> ExtractedToolCalls:
    """Every chunking's deltas reassemble into `extract(text)`; each call's first delta has its id and name, later
    ones neither, and indices count up from 0."""
    whole = make().extract(text)
    for pieces in chunkings(text, random.Random(seed)):
        p = make()
        deltas = stream(p, pieces)
        assert not p.failed
        assert fold(deltas) == whole, (pieces, fold(deltas), whole)
        seen: set[int] = set()
        for piece in (c for d in deltas for c in d.tool_calls):
            first = piece.index not in seen
            assert (piece.id is not None, piece.name is not None) == (first, first), piece
            if first:
                assert piece.index == len(seen)
                seen.add(piece.index)
    return whole


# ------------------------------------------------------------------------------------------ well-formed outputs

WEATHER = {"city": "Paris", "days": [1, 2], "opts": {"unit": "c", "note": 'a "quoted" } brace'}}
WELL_FORMED = {
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}\n</tool_call>",
            None,
            [("get_weather", json.dumps(WEATHER))],
        ),
        (
            'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
            '{"arguments": {"y": [true, null, 2.5e-3]}, "name": "b"}\n</tool_call>\n',
            "Let me look.\n",
            [("a", '{"x": 1}'), ("b", '{"y": [true, null, 2.5e-3]}')],
        ),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone, <tool>s are tags.',
            "\nDone, <tool>s are tags.",
            [("f", "{}")],
        ),
        (
            '<tool_call>{"name": "last", "arguments": {"unterminated": "tag"}}',
            None,
            [("last", '{"unterminated": "tag"}')],
        ),
        (
            '<tool_call>{"name": "uni\\u00e9", "extra": [1, {"n": 2}], "arguments": "{\\"s\\": 1}"}</tool_call>',
            None,
            [("unié", '"{\\"s\\": 1}"')],
        ),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
            None,
            [("get_weather", json.dumps(WEATHER))],
        ),
        (
            '  <|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z"}}',
            None,
            [("a", '{"x": 1}'), ("b", '{"y": "z"}')],
        ),
        ('{"name": "a", "parameters": {"x": -1.5}}\n\nThat is all.', "\n\nThat is all.", [("a", '{"x": -1.5}')]),
    ],
    "mistral": [
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}, "
            '{"name": "b", "arguments": {}}]',
            None,
            [("get_weather", json.dumps(WEATHER)), ("b", "{}")],
        ),
        (
            'Sure. [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
            "Sure. ",
            [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')],
        ),
        ('[TOOL_CALLS]a{"x": [1, {"y": "}"}]},b{}', None, [("a", '{"x": [1, {"y": "}"}]}'), ("b", "{}")]),
    ],
    "pythonic": [
        (
            "[get_weather(city=\"Paris\", unit='c'), get_time()]",
            None,
            [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")],
        ),
        (
            "\n[f(a=[1, -2.5, 1e3, {'k': None, \"q\": [True, False]}], b='it\\'s \"x\"\\n', c=0x10,)]",
            None,
            [("f", '{"a": [1, -2.5, 1000.0, {"k": null, "q": [true, false]}], "b": "it\'s \\"x\\"\\n", "c": 16}')],
        ),
        (
            '[f(x=1), g(y={"nested": {"deep": []}})] and some words',
            " and some words",
            [("f", '{"x": 1}'), ("g", '{"y": {"nested": {"deep": []}}}')],
        ),
    ],
}


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_well_formed_outputs_whole_and_streamed(name):
    for i, (text, content, calls) in enumerate(WELL_FORMED[name]):
        whole = assert_streams_like_whole(lambda: parser(name), text, seed=i)
        assert (whole.content, calls_of(whole)) == (content, calls), text
        for call in whole.tool_calls:
            json.loads(call.arguments)
            assert call.id == "call-id"


def test_every_registered_parser_is_covered_and_unknown_names_list_the_choices():
    assert tool_parser_names() == sorted(WELL_FORMED)
    with pytest.raises(KeyError) as info:
        get_tool_parser("nope")
    assert "hermes" in str(info.value) and "pythonic" in str(info.value)


def test_tool_call_ids_are_vllms():
    ids = {
        get_tool_parser("hermes")().extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>').tool_calls[0].id
        for _ in range(5)
    }
    assert len(ids) == 5 and all(i.startswith("chatcmpl-tool-") and len(i) == 14 + 32 for i in ids)
    assert random_tool_call_id() != random_tool_call_id()
    mistral = get_tool_parser("mistral")().extract("[TOOL_CALLS]f{}").tool_calls[0].id
    assert len(mistral) == 9 and mistral.isalnum() and len(mistral_tool_call_id()) == 9
    assert get_tool_parser("mistral").keeps_special_tokens and not get_tool_parser("hermes").keeps_special_tokens


def test_plain_text_is_all_content_in_every_parser():
    texts = [
        "",
        "Hello there.",
        "   spaced  ",
        "a < b and c > d",
        "<tool_cal",
        "[TOOL_CALL",
        "{not json",
        "[1, 2, 3]",
        "<|python_ta",
        "Call f(x=1) please",
    ]
    for name in tool_parser_names():
        for text in texts:
            whole = parser(name).extract(text)
            assert (whole.content, whole.tool_calls) == (text, []), (name, text)
            for pieces in chunkings(text, random.Random(1), 5):
                assert fold(stream(parser(name), pieces)) == whole


# ------------------------------------------------------------------------------------------ malformed outputs

MALFORMED = {
    "hermes": [
        "<tool_call>not json</tool_call> after",
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',
        'x <tool_call>[{"name": "f", "arguments": {}}]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": "cut off',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": [}',
    ],
    "llama3_json": [
        '{"name": "f"}',
        '{"name": "f", "parameters": {}, "arguments": {}}',
        'Sure: {"name": "f"}',
        '{"name": "f", "parameters": {"a": [1, 2}}',
        '{"name": "f", "parameters": {"a"',
    ],
    "mistral": [
        "[TOOL_CALLS] sorry, no",
        '[TOOL_CALLS] [{"name": "f"}]',
        '[TOOL_CALLS]f {"a": 1}',
        '[TOOL_CALLS] [{"name": "f", "arguments": {}}',
        '[TOOL_CALLS]f{"a": nope}',
    ],
    "pythonic": [
        "[1, 2]",
        "[f(x)]",
        "[f(a=b)]",
        "[f(a=1) g()]",
        "[f(a='unterminated)]",
        "[f(a=1+2j)]",
        "[f(a={1: 2})]",
        "[f(a=float('inf'))]",
        "[f(a=1)",
    ],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_outputs_fall_back_to_content(name):
    """As vLLM: a whole malformed output is content, no calls. Streamed, a malformed call noticed before any call
    went out is content too; one noticed after can no longer be taken back, and the parser says so (`failed`)."""
    for text in MALFORMED[name]:
        whole = parser(name).extract(text)
        assert (whole.content, whole.tool_calls) == (text, []), text
        for pieces in chunkings(text, random.Random(2), 10):
            p = parser(name)
            folded = fold(stream(p, pieces))
            if not p.failed:
                assert folded == whole, (text, pieces)
            else:
                assert folded.tool_calls, "a parser fails only once it has streamed a call"


def test_a_malformed_call_before_any_call_streams_as_content():
    for name, text in [
        ("hermes", "Hi <tool_call>oops</tool_call> bye"),
        ("pythonic", "[1, 2]"),
        ("llama3_json", '{"name": "f"}'),
        ("mistral", "[TOOL_CALLS] nothing"),
    ]:
        for pieces in chunkings(text, random.Random(3), 10):
            p = parser(name)
            assert fold(stream(p, pieces)) == ExtractedToolCalls(text, []) and not p.failed


def test_truncated_outputs_either_parse_or_are_content():
    """Every prefix of a well-formed output (a generation cut by max_tokens): calls with valid JSON arguments, or
    the text as content; streamed, the same unless the parser reports a call it could not take back."""
    for name, cases in WELL_FORMED.items():
        for text, _, _ in cases:
            for end in range(len(text) + 1):
                prefix = text[:end]
                whole = parser(name).extract(prefix)
                if whole.tool_calls:
                    for call in whole.tool_calls:
                        json.loads(call.arguments)
                else:
                    assert whole.content == prefix
                p = parser(name)
                folded = fold(stream(p, [prefix[: end // 2], prefix[end // 2 :]]))
                assert p.failed or folded == whole, (name, prefix)


# ------------------------------------------------------------------------------------------ generated outputs

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
ARGUMENTS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
CALLS = st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3)


def random_pieces(text: str, seed: int) -> list[str]:
    return (
        next(iter(chunkings(text, random.Random(seed), 1)))
        if seed % 3 == 0
        else list(chunkings(text, random.Random(seed), 1))[-1]
    )


@settings(max_examples=150, deadline=None)
@given(CALLS, st.text(max_size=20).filter(lambda t: "<" not in t), st.booleans(), st.integers(0, 10**6))
def test_hermes_reads_any_generated_calls(calls, before, compact, seed):
    separators = (",", ":") if compact else None
    text = before + "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, separators=separators)}\n</tool_call>\n"
        for n, a in calls
    )
    whole = parser("hermes").extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [(n, a) for n, a in calls]
    assert whole.content == (before or None)
    p = parser("hermes")
    assert fold(stream(p, random_pieces(text, seed))) == whole


@settings(max_examples=150, deadline=None)
@given(CALLS, st.integers(0, 10**6))
def test_llama3_mistral_and_required_read_any_generated_calls(calls, seed):
    texts = {
        "llama3_json": "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls),
        "mistral": "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls]),
        "mistral_v11": "".join(f"[TOOL_CALLS]{n}{json.dumps(a)}" for n, a in calls),
    }
    for key, text in texts.items():
        name = key.removesuffix("_v11")
        whole = parser(name).extract(text)
        assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [(n, a) for n, a in calls], text
        assert fold(stream(parser(name), random_pieces(text, seed))) == whole
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls], separators=(",", ":"))
    whole = RequiredToolCallsParser().extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [(n, a) for n, a in calls]
    assert fold(
        stream(RequiredToolCallsParser(make_id=fixed_id), random_pieces(text, seed))
    ) == RequiredToolCallsParser(make_id=fixed_id).extract(text)


PY_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
IDENTIFIERS = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(IDENTIFIERS, st.dictionaries(IDENTIFIERS, PY_VALUES, max_size=4)), min_size=1, max_size=3),
    st.integers(0, 10**6),
)
def test_pythonic_reads_any_generated_calls(calls, seed):
    text = "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"
    whole = parser("pythonic").extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [(n, a) for n, a in calls], text
    assert fold(stream(parser("pythonic"), random_pieces(text, seed))) == whole


# ------------------------------------------------------------------------------------------ forced tool_choice


def test_named_function_output_is_its_arguments():
    text = '{"city": "Paris"}'
    whole = assert_streams_like_whole(lambda: NamedToolCallParser("get_weather", make_id=fixed_id), text)
    assert (whole.content, calls_of(whole)) == (None, [("get_weather", text)])
    assert NamedToolCallParser("f").extract("") == ExtractedToolCalls("", [])


def test_required_output_is_a_list_of_calls():
    text = '[{"name":"a","parameters":{"x":1}},{"parameters":{},"name":"b"}]'
    whole = assert_streams_like_whole(lambda: RequiredToolCallsParser(make_id=fixed_id), text)
    assert (whole.content, calls_of(whole)) == (None, [("a", '{"x":1}'), ("b", "{}")])
    for bad in [
        "[]",
        '{"name": "a", "parameters": {}}',
        '[{"name": "a"}]',
        '[{"name":"a","parameters":{}}',
        '[{"name":"a","parameters":{}}] extra',
    ]:
        assert RequiredToolCallsParser().extract(bad) == ExtractedToolCalls(bad, []), bad


MUTATIONS = [
    "<tool_call>",
    "</tool_call>",
    "}",
    "{",
    "[",
    "]",
    '"',
    "\\",
    " ",
    "\n",
    "[TOOL_CALLS]",
    ",",
    ";",
    ")",
    "(",
    "'",
    "x",
    "=",
    ":",
]


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_mutated_outputs_stream_like_whole(name):
    """Well-formed outputs with characters inserted or deleted at random: whatever they parse into (calls with JSON
    arguments, or the text as content), every chunking that did not fail gives the same."""
    rng = random.Random(name)
    outcomes = set()
    for _ in range(400):
        text = rng.choice(WELL_FORMED[name])[0]
        for _ in range(rng.randint(1, 2)):
            at = rng.randrange(len(text) + 1)
            text = (
                text[:at] + rng.choice(MUTATIONS) + text[at:]
                if rng.random() < 0.5
                else text[:at] + text[at + rng.randint(1, 3) :]
            )
        whole = parser(name).extract(text)
        for call in whole.tool_calls:
            json.loads(call.arguments)
        if not whole.tool_calls:
            assert whole.content == text
        for pieces in chunkings(text, rng, 3):
            p = parser(name)
            folded = fold(stream(p, pieces))
            assert p.failed or folded == whole, (text, pieces)
            outcomes.add((bool(whole.tool_calls), p.failed))
    assert {(True, False), (False, False), (False, True)} <= outcomes  # calls, content, and streamed-then-failed


@pytest.mark.parametrize("field", ["tool_call_parser", "reasoning_parser"])
def test_an_unknown_parser_name_fails_at_start_up(field):
    from tokenmill.config import ServerConfig
    from tokenmill.frontend.context import check_parser_names

    check_parser_names(ServerConfig(tool_call_parser="hermes", reasoning_parser="qwen3"))
    with pytest.raises(ValueError, match="unknown .* parser 'nope'"):
        check_parser_names(ServerConfig(**{field: "nope"}))
