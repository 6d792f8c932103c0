"""A Lark / GBNF grammar's largest unrolled repetition: regex terminals, counts on items, rules referenced under a
count and `%json` schemas; loops, strings, comments and directive blocks count nothing."""

from __future__ import annotations

import pytest

from tokenmill.grammar_bounds import check_grammar
from tokenmill.grammars import GrammarError, _as_lark, validate
from tokenmill.messages import StructuredOutputsParams
from tokenmill.regex_bounds import RegexTooRepetitive

TOO_MANY = [
    "start: /(a|b)*c{1000000}/",  # a regex terminal
    "start: x\nx: /((c{100}){100}){100}/",  # nested counts inside the terminal of another rule
    'start: a{100}\na: b ~ 100\nb: "c"{2}',  # counts multiplied through references (Lark's `~` among them)
    'start: ("a"{100} "b"){101}',  # a group's count multiplies what is inside it
    "start: /[0-9]{5}/{3000}",  # a count on a terminal that repeats inside
    'start: %json {"type": "string", "pattern": "a{99999}"}',  # an embedded schema's pattern
    "root ::= [a-z]{1000000}",  # GBNF, as converted to Lark
]

WITHIN = [
    'start: ("a"{100} "b"){100}',  # exactly the bound
    'start: x\nx: "a" x | "b"{3}',  # recursion is a loop, not a copy
    '// a comment: /x{99999}/\nstart: "{99999}" /[0-9]{1,5}/',  # a comment and a string hold no counts
    "%llguidance {}\nstart: /a+/ /b*/",  # a directive's block is JSON, and loops copy nothing
    'start: %json {"type": "object", "properties": {"a": {"type": "string", "maxLength": 9}}}',
]


@pytest.mark.parametrize("grammar", TOO_MANY)
def test_a_grammar_repeating_past_the_bound_is_refused(grammar: str) -> None:
    with pytest.raises(RegexTooRepetitive, match="10000"):
        check_grammar(_as_lark(grammar))
    with pytest.raises(GrammarError, match="repeats a piece"):  # what the frontend turns into a 400
        validate(StructuredOutputsParams(grammar=grammar))


@pytest.mark.parametrize("grammar", WITHIN)
def test_a_grammar_within_the_bound_is_accepted(grammar: str) -> None:
    check_grammar(_as_lark(grammar))
    validate(StructuredOutputsParams(grammar=grammar))


def test_the_refusal_says_how_many_copies() -> None:
    with pytest.raises(RegexTooRepetitive, match="the grammar repeats a piece 20000 times"):
        check_grammar('start: a{100}\na: b ~ 100\nb: "c"{2}')


def test_a_chain_of_rules_past_the_depth_is_refused_not_a_crash() -> None:
    def chain(depth: int) -> str:
        return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(depth)) + f'r{depth}: "a"\n'

    check_grammar(chain(150))
    with pytest.raises(RegexTooRepetitive, match="more than 200 deep"):
        check_grammar(chain(5000))  # not a RecursionError
    with pytest.raises(GrammarError, match="200 deep"):
        validate(StructuredOutputsParams(grammar=chain(5000)))
