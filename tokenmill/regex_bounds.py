"""How many times a client's regex repeats a piece, checked before its grammar is accepted (issue 28).

llguidance validates a regex's syntax at admission but builds its automaton only when the scheduler compiles the
grammar for a request, so `(a|b)*c{1000000}` passed validation and failed (after a long build) at run time. A
counted repetition `{m}`, `{m,}`, `{m,n}` unrolls into that many copies of its piece, and nested counts multiply
(`((c{100}){100}){100}` is a million copies), so the bound is on the product of the counts along a nesting: at most
`MAX_REGEX_REPETITION`. `*`, `+` and `?` are loops, not copies, and cost nothing here. The walk is one linear pass
that knows escapes (`\\{`, `\\p{Greek}`, `\\x{41}`), character classes (a brace inside `[...]` is literal) and groups.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

# A fixed bound rather than a flag: ten thousand copies of a piece compile in milliseconds, and no JSON field or
# output format a client constrains needs a longer unrolled run (an unbounded one is written `*` or `{m,}`).
MAX_REGEX_REPETITION = 10_000

_COUNTED = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")  # {m}, {m,}, {m,n}, {,n}
_ESCAPES_WITH_BRACES = frozenset("pPxu")  # \p{Greek}, \x{10FFFF}, \u{...}: braces that are not a count
# keys whose values are data, not subschemas: a "pattern" inside them constrains nothing
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


class RegexTooRepetitive(ValueError):
    """The regex unrolls a piece more than `MAX_REGEX_REPETITION` times."""


def largest_repetition(regex: str) -> int:
    """The largest number of copies of one piece the regex's counted repetitions unroll (nested counts
    multiplied; 1 without counts)."""
    # per open group: [the largest count product seen inside, the product of the last piece (what a count repeats)]
    groups: list[list[int]] = [[1, 1]]
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            i = _after_escape(regex, i)
            groups[-1][1] = 1
            continue
        if char == "[":
            i = _after_class(regex, i)
            groups[-1][1] = 1
            continue
        if char == "(":
            groups.append([1, 1])
        elif char == ")" and len(groups) > 1:
            inner = groups.pop()[0]
            groups[-1][0] = max(groups[-1][0], inner)
            groups[-1][1] = inner
        elif char == "{" and (count := _COUNTED.match(regex, i)) and (count.group(1) or count.group(2)):
            groups[-1][1] *= repetition_count(count.group(2) or count.group(1))
            groups[-1][0] = max(groups[-1][0], groups[-1][1])
            i = count.end()
            continue
        elif char not in "*+?|^$)":
            groups[-1][1] = 1
        i += 1
    return max(group[0] for group in groups)


def check_regex(regex: str, where: str) -> None:
    """RegexTooRepetitive naming `where` when the regex unrolls a piece more than `MAX_REGEX_REPETITION` times."""
    largest = largest_repetition(regex)
    if largest > MAX_REGEX_REPETITION:
        raise RegexTooRepetitive(
            f"{where} repeats a piece {shown_count(largest)} times (nested counts multiplied); at most "
            f"{MAX_REGEX_REPETITION} are allowed (write an unbounded run as `*` or `{{m,}}`)"
        )


def check_schema_patterns(schema: str | dict[str, Any]) -> None:
    """`check_regex` on every `pattern` and `patternProperties` key of a JSON schema (an object or JSON text)."""
    tree = json.loads(schema) if isinstance(schema, str) else schema
    for where, regex in _schema_patterns(tree, "schema"):
        check_regex(regex, where)


def _schema_patterns(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """(where, regex) of every pattern in a schema tree; data values (enum, const, default, examples) skipped."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from _schema_patterns(item, f"{path}[{index}]")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            continue
        if key == "pattern" and isinstance(value, str):
            yield f"{path}.pattern", value
        elif key == "patternProperties" and isinstance(value, dict):
            yield from ((f"{path}.patternProperties key", name) for name in value)
            yield from _schema_patterns(value, f"{path}.patternProperties")
        else:
            yield from _schema_patterns(value, f"{path}.{key}")


def repetition_count(digits: str) -> int:
    # Python refuses int() of very long digit strings; anything past nine digits is over the bound anyway
    return int(digits) if len(digits) <= 9 else 10**9


def shown_count(count: int) -> str:
    return f"at least {count}" if count >= 10**9 else str(count)


def _after_escape(regex: str, i: int) -> int:
    """The index after the escape at `i` (a braced `\\p{..}` / `\\x{..}` / `\\u{..}` whole)."""
    if i + 2 < len(regex) and regex[i + 1] in _ESCAPES_WITH_BRACES and regex[i + 2] == "{":
        close = regex.find("}", i + 3)
        return len(regex) if close < 0 else close + 1
    return i + 2


def _after_class(regex: str, i: int) -> int:
    """The index after the character class opening at `i` (nested classes, escapes, a leading `]` or `^]`)."""
    depth = 0
    j = i
    while j < len(regex):
        char = regex[j]
        if char == "\\":
            j = _after_escape(regex, j)
            continue
        if char == "[":
            depth += 1
            j += 1
            if regex.startswith("^", j):
                j += 1
            if regex.startswith("]", j):  # a literal `]` right after the opening
                j += 1
            continue
        if char == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return j
