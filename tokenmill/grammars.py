"""Structured-output constraints (`StructuredOutputsParams`) as llguidance grammars.

One function turns a constraint into llguidance's grammar text; the frontend validates that text (an invalid schema
or grammar is a 400 before the request reaches the engine) and the scheduler compiles it into matchers. llguidance
was chosen over xgrammar by measurement on the default model's 49k vocabulary (scripts/bench_structured_outputs.py
reports the serving figures): it compiles a fresh schema in under a millisecond instead of tens (agents send a
different schema with nearly every request), a batch-32 mask costs well under a millisecond per step, it reads
Lark grammars and JSON schema natively with wide schema coverage, it can roll back (speculative decoding), and it
needs neither torch nor a compiler in the scheduler process.

JSON is generated compact (no optional whitespace), as vLLM's `disable_any_whitespace`: optional whitespace lets a
sampled model pad its output until it runs out of tokens, and compact JSON is valid under the same schema.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from tokenmill.grammar_bounds import check_grammar
from tokenmill.messages import StructuredOutputsParams
from tokenmill.regex_bounds import RegexTooRepetitive, check_regex, check_schema_patterns

# what a client's grammar may cost to build and to step: llguidance's own fuel limits, tightened where a hostile
# schema could otherwise hold a compile thread or a scheduler step for long
PARSER_LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=500_000,
    verbose_errors=False,
)

JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The constraint cannot be compiled: the message says why, in the client's terms."""


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def constraint_kind(params: StructuredOutputsParams) -> str:
    """The one constraint the params set (`json`, `json_object`, `regex`, `choice`, `grammar`, `structural_tag`)."""
    kinds = [
        name for name in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(params, name) is not None
    ]
    if params.json_object:
        kinds.append("json_object")
    if len(kinds) != 1:
        raise GrammarError(
            "exactly one structured-output constraint must be set, got " + (", ".join(kinds) if kinds else "none")
        )
    return kinds[0]


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for the constraint (not yet validated: see `validate`)."""
    kind = constraint_kind(params)
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            if not params.choice:
                raise GrammarError("choice must list at least one string")
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice) for choice in params.choice)
            )
        if kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(_as_lark(params.grammar))
        return _structural_tag_grammar(params.structural_tag)
    except GrammarError:
        raise
    except (ValueError, TypeError, KeyError, AssertionError, GbnfToLarkError) as exc:
        raise GrammarError(f"the {kind} constraint is not valid: {exc}") from None


def _as_lark(grammar: str) -> str:
    """Lark as is; a GBNF / EBNF grammar (rules written `name ::= ...`, llama.cpp's format) converted to Lark."""
    if "::=" in grammar:
        return gbnf_to_lark(grammar)
    return grammar


def _structural_tag_grammar(spec: str | dict) -> str:
    """vLLM's structural tag: `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free text, with a
    schema-constrained segment wherever the model writes one of the triggers."""
    tag = json.loads(spec) if isinstance(spec, str) else spec
    if (
        not isinstance(tag, dict)
        or not isinstance(tag.get("structures"), list)
        or not isinstance(tag.get("triggers"), list)
        or not tag["structures"]
    ):
        raise GrammarError("structural_tag must be an object with non-empty `structures` and `triggers` lists")
    tags = []
    for structure in tag["structures"]:
        if not isinstance(structure, dict) or not all(k in structure for k in ("begin", "schema", "end")):
            raise GrammarError("every structural_tag structure needs `begin`, `schema` and `end`")
        if not isinstance(structure["begin"], str) or not isinstance(structure["end"], str):
            raise GrammarError("a structural_tag structure's `begin` and `end` must be strings")
        begin = structure["begin"]
        trigger = next((t for t in tag["triggers"] if isinstance(t, str) and t and begin.startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"no structural_tag trigger starts the structure beginning {begin!r}")
        tags.append(
            llguidance.StructTag(trigger=trigger, begin=begin, grammar=structure["schema"], end=structure["end"])
        )
    return llguidance.StructTag.to_grammar(tags)


# JSON-schema keywords that describe a value without constraining it: no grammar reads them, and a client can pad
# them to megabytes (a 2 MB schema of descriptions took 20-30 ms of GIL in each process that built its grammar)
ANNOTATION_KEYWORDS = frozenset({"description", "title", "examples", "$comment", "deprecated", "readOnly", "writeOnly"})
# keywords whose value maps names (property names, definition names) to subschemas: a name is never a keyword
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def without_annotations(schema: Any) -> Any:
    """A JSON schema without its annotations (`ANNOTATION_KEYWORDS`), wherever a subschema sits; property and
    definition names stay, whatever they are called (a property named `description` is kept). Other values (enum,
    const, default) are kept as they are."""
    if isinstance(schema, list):
        return [without_annotations(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kept: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATION_KEYWORDS:
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):
            kept[key] = {name: without_annotations(sub) for name, sub in value.items()}
        elif key in ("enum", "const", "default", "required"):
            kept[key] = value
        else:
            kept[key] = without_annotations(value)
    return kept


def validate(params: StructuredOutputsParams) -> str:
    """The grammar text for `params`, checked to compile within `PARSER_LIMITS` and its regexes to unroll within
    `MAX_REGEX_REPETITION` (llguidance builds a regex's automaton only at run time); GrammarError says why not."""
    grammar = grammar_text(params)
    _check_repetitions(params)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    if is_error:
        raise GrammarError(messages[0] if messages else "the constraint does not compile")
    return grammar


def _check_repetitions(params: StructuredOutputsParams) -> None:
    """GrammarError when the regex, a pattern of the JSON schema, or the grammar unrolls a piece too many times."""
    try:
        if params.regex is not None:
            check_regex(params.regex, "the regex")
        if params.json is not None:
            check_schema_patterns(params.json)
        if params.grammar is not None:
            check_grammar(_as_lark(params.grammar))
    except RegexTooRepetitive as exc:
        raise GrammarError(str(exc)) from None
