"""How many times a client's Lark grammar (or GBNF, converted to Lark) unrolls a piece, checked at admission.

`tokenmill/regex_bounds.py` bounds a regex's counted repetitions; a grammar has them in three places, all unrolled by
llguidance when the scheduler compiles it, none at validation (`start: /c{1000000}/` validated in under a
millisecond): the regex terminals `/.../`, counts on an item (`x{m,n}`, Lark's `x ~ m..n`, GBNF's `x{m}` as
converted) and the JSON schemas of `%json {...}`. Counts multiply through nesting, through groups within a rule and
through a rule referenced under a count (`a: b{100}` with `b: /c{100}/` is 10,000 copies of `c`), so a rule's cost is
the largest product down any chain of references (a rule referenced from inside itself is a loop, not a copy). The
bound is `MAX_REGEX_REPETITION`, the regexes'.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenmill.regex_bounds import (
    MAX_REGEX_REPETITION,
    RegexTooRepetitive,
    check_schema_patterns,
    largest_repetition,
    repetition_count,
    shown_count,
)

_TOKEN = re.compile(
    r"""(?P<space>\s+)
    |(?P<comment>//[^\n]*)
    |(?P<string>"(?:\\.|[^"\\])*"i?)
    |(?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
    |(?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\}|~\s*\d+(?:\s*\.\.\s*\d+)?)
    |(?P<open>[(\[])
    |(?P<close>[)\]])
    |(?P<directive>%\w+)
    |(?P<name>[?!]?[A-Za-z_]\w*(?:\.-?\d+)?)
    |(?P<define>::=|:)
    |(?P<other>.)""",
    re.VERBOSE,
)
_DIGITS = re.compile(r"\d+")
_CAP = 10**12  # products stop growing here: far past the bound, and no huge integers
# rules referenced within rules, deepest chain walked: deeper is refused (a chain of thousands would exhaust Python's
# stack, and a depth past which references counted nothing would let counts below it through)
MAX_RULE_DEPTH = 200


@dataclass
class _Item:
    """One token of a rule's body that counts: a piece (regex, rule reference, group edge) or a count."""

    kind: str  # "regex", "name", "open", "close", "count"
    value: str


def check_grammar(lark: str, where: str = "the grammar") -> None:
    """RegexTooRepetitive naming `where` when the grammar unrolls a piece more than `MAX_REGEX_REPETITION` times."""
    rules = _rules(lark, where)
    largest = max((_Unroller(rules).rule(name) for name in rules), default=1)
    if largest > MAX_REGEX_REPETITION:
        raise RegexTooRepetitive(
            f"{where} repeats a piece {shown_count(largest)} times (counts and regex terminals multiplied through "
            f"rules); at most {MAX_REGEX_REPETITION} are allowed (write an unbounded run as `*` or `+`)"
        )


def _rules(lark: str, where: str) -> dict[str, list[_Item]]:
    """Each rule's (or terminal's) body as the items that count; `%json` schemas checked on the way."""
    rules: dict[str, list[_Item]] = {}
    body: list[_Item] = []
    pending_name: str | None = None  # a name that a `:` after it would make a rule's
    position = 0
    while position < len(lark):
        match = _TOKEN.match(lark, position)
        assert match is not None  # `other` matches any character
        kind, text, position = match.lastgroup, match.group(), match.end()
        if kind in ("space", "comment"):
            continue
        if kind == "define" and pending_name is not None:
            body.pop()  # the name was the new rule's, not a reference in the previous body
            body = rules.setdefault(pending_name.lstrip("?!").split(".")[0], [])
        elif kind == "directive":
            position = _after_directive_block(lark, position, text, where)
        elif kind in ("regex", "name", "open", "close", "count"):
            body.append(_Item(kind, text))
        pending_name = text if kind == "name" else None
    return rules


def _after_directive_block(lark: str, position: int, directive: str, where: str) -> int:
    """The position after a directive's `{...}` block (JSON: its braces are not counts); a `%json` schema's
    patterns are checked as a schema's are."""
    start = position
    while start < len(lark) and lark[start] in " \t":
        start += 1
    if not lark.startswith("{", start):
        return position
    try:
        block, end = json.JSONDecoder().raw_decode(lark, start)
    except ValueError:
        return position
    if directive == "%json":
        check_schema_patterns(block)
    return end


class _Unroller:
    """A rule's largest unrolled repetition, memoised; a rule reached again while its own is being computed is a
    loop (recursion), which copies nothing."""

    def __init__(self, rules: dict[str, list[_Item]]) -> None:
        self.rules = rules
        self.done: dict[str, int] = {}
        self.active: set[str] = set()

    def rule(self, name: str) -> int:
        if name in self.done:
            return self.done[name]
        if name in self.active or name not in self.rules:
            return 1
        if len(self.active) >= MAX_RULE_DEPTH:
            raise RegexTooRepetitive(f"the grammar references rules more than {MAX_RULE_DEPTH} deep")
        self.active.add(name)
        self.done[name] = self._body(self.rules[name])
        self.active.discard(name)
        return self.done[name]

    def _body(self, items: list[_Item]) -> int:
        # per open group: [the largest product seen inside, the product of the last piece (what a count repeats)]
        groups: list[list[int]] = [[1, 1]]
        for item in items:
            if item.kind == "open":
                groups.append([1, 1])
                continue
            if item.kind == "close" and len(groups) > 1:
                largest = groups.pop()[0]
                groups[-1][1] = largest
            elif item.kind == "count":
                counts = [repetition_count(digits) for digits in _DIGITS.findall(item.value)]
                groups[-1][1] = min(groups[-1][1] * max(counts), _CAP)
            elif item.kind == "regex":
                groups[-1][1] = largest_repetition(item.value[1 : item.value.rindex("/")])
            elif item.kind == "name":
                groups[-1][1] = self.rule(item.value.lstrip("?!"))
            else:
                groups[-1][1] = 1
            groups[-1][0] = max(groups[-1][0], groups[-1][1])
        return max(group[0] for group in groups)
