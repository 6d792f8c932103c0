"""A regex's largest unrolled repetition: counts multiply through nesting; escapes, classes and loops count nothing."""

from __future__ import annotations

import pytest

from tokenmill.regex_bounds import (
    MAX_REGEX_REPETITION,
    RegexTooRepetitive,
    check_regex,
    check_schema_patterns,
    largest_repetition,
)


@pytest.mark.parametrize(
    ("regex", "expected"),
    [
        ("abc", 1),
        ("(a|b)*c+d?", 1),
        ("(a|b)*c{1000000}", 1_000_000),
        ("[a-z]{2,5}", 5),
        ("x{3,}", 3),
        ("a{,20000}", 20_000),
        ("(c{100}){100}", 10_000),
        ("((c{100}){100}){100}", 1_000_000),
        ("(a{50})(b{20})", 50),  # siblings do not multiply
        ("(?:ab{7}|c{9})", 9),
        (r"\{99999\}", 1),  # escaped braces are literals
        (r"\p{Greek}{3}", 3),  # a Unicode class's braces are not a count
        (r"\x{41}", 1),
        ("[{]{99999}", 99_999),  # a brace inside a class is literal; the count after it is not
        ("[]{}]{8}", 8),
        ("[[:alpha:]]{7}", 7),
        ("a{x}", 1),  # not a count: a literal brace
        ("a{" + "9" * 5000 + "}", 10**9),  # no int() of 5000 digits
    ],
)
def test_largest_repetition(regex: str, expected: int) -> None:
    assert largest_repetition(regex) == expected


def test_check_regex_refuses_past_the_bound_naming_where() -> None:
    check_regex(f"c{{{MAX_REGEX_REPETITION}}}", "the regex")
    with pytest.raises(RegexTooRepetitive, match="the regex repeats a piece 10001 times"):
        check_regex(f"c{{{MAX_REGEX_REPETITION + 1}}}", "the regex")


def test_schema_patterns_are_checked_wherever_a_subschema_sits() -> None:
    item = {"type": "object", "properties": {"p": {"type": "string", "pattern": "a{99999}"}}}
    nested = {"type": "array", "items": item}
    with pytest.raises(RegexTooRepetitive, match=r"schema\.items\.properties\.p\.pattern"):
        check_schema_patterns(nested)
    with pytest.raises(RegexTooRepetitive, match="patternProperties key"):
        check_schema_patterns('{"type": "object", "patternProperties": {"^x{20000}$": {"type": "integer"}}}')
    # a property named `pattern`, and data values, are not regexes
    check_schema_patterns({"properties": {"pattern": {"type": "string"}}, "enum": [{"pattern": "a{99999}"}]})
