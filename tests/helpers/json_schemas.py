"""Random JSON schemas for the structured-output tests: nested objects, arrays, enums, anyOf, string patterns and
lengths, number bounds, required and optional properties, nulls and booleans.

Every schema is bounded (strings have a maxLength or a bounded pattern, arrays a maxItems, numbers both bounds and a
`multipleOf`, nesting a depth), so every instance is short. Numbers need the `multipleOf`: JSON Schema has no other
way to bound a number's digits, and a fraction of unbounded length is a language with no length limit. A sampled model
can stay in it past any token budget: without it, 2 of 200 outputs at temperature 1 were 400 tokens of digits.
The steps are binary fractions, so `jsonschema`'s float division checks them exactly.
"""

from __future__ import annotations

import random
import string
from typing import Any

PATTERNS = [
    r"^[a-z]{1,8}$",
    r"^[A-Z]{2}-[0-9]{3}$",
    r"^(red|green|blue)$",
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$",
    r"^[a-f0-9]{6}$",
]
WORDS = ["alpha", "beta", "gamma", "delta", "north", "south", "cat", "dog", "yes", "no", "x y", "ünï"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A schema for a top-level object (the usual shape of `response_format` schemas)."""
    return _object(rng, depth)


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "pattern", "null"]
    if depth < 2:
        kinds += ["object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        low = rng.randint(-100, 100)
        return {
            "type": "number",
            "minimum": low,
            "maximum": low + rng.randint(1, 200),
            "multipleOf": rng.choice([0.5, 0.25, 0.125]),
        }
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        values: list[Any] = rng.sample(WORDS, rng.randint(1, 4))
        if rng.random() < 0.3:
            values.append(rng.randint(0, 9))
        return {"enum": values}
    if kind == "object":
        return _object(rng, depth + 1)
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 3)}
    return {"anyOf": [_value(rng, depth + 1) for _ in range(rng.randint(2, 3))]}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    words = ("id", "name", "value", "item", "flag", "info")
    names = rng.sample([f"{w}_{c}" for w in words for c in string.ascii_lowercase[:4]], rng.randint(1, 4))
    properties = {name: _value(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema
