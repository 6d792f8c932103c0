"""A request's structured-output constraint, from whichever field it uses, checked before it reaches the engine.

Chat and completions take one of: OpenAI's `response_format` (`json_object`, `json_schema`, vLLM's
`structural_tag`; `text` is no constraint), vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`,
`json_object`, `structural_tag`), or vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. More than one is a 400. The constraint is compiled once here, on a template thread
(`tokenmill.grammars.validate`, bounded by llguidance's parser limits), so an invalid schema, regex or grammar is a
400 naming the field rather than a failed generation; the scheduler compiles it again for the model's tokenizer.
A JSON schema travels without its annotations (descriptions, titles, examples), and what is left is bounded in bytes
(--max-structured-outputs-bytes): building a grammar costs time in proportion to it, in two processes (issue 28).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tokenmill.frontend.errors import APIError
from tokenmill.grammars import GrammarError, validate, without_annotations
from tokenmill.messages import StructuredOutputsParams, encode

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
BACKENDS = (None, "auto", "guidance", "llguidance")


class StructuredOutputsField(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` request object, as far as tokenmill implements it."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    # accepted: JSON output is always compact (no optional whitespace) and llguidance never falls back
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    backend: str | None = None


def requested_structured_outputs(request: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field it came from (for errors), or None. 400 on a malformed field or when
    the request sets more than one."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None:
        params = _from_response_format(response_format)
        if params is not None:
            found.append((params, "response_format"))
    field = getattr(request, "structured_outputs", None)
    if field is not None:
        found.append((_from_structured_outputs(field), "structured_outputs"))
    for name, key in GUIDED_FIELDS.items():
        value = getattr(request, name, None)
        if value is not None:
            found.append((_convert({key: value}, name), name))
    if len(found) > 1:
        raise APIError(
            400,
            f"Only one structured-output constraint may be set; this request sets "
            f"{', '.join(source for _, source in found)}.",
            found[1][1],
        )
    return found[0] if found else None


def _convert(value: Any, param: str) -> StructuredOutputsParams:
    """`value` (an object with vLLM's `structured_outputs` keys) as params; 400 naming `param` on a bad type."""
    try:
        field = msgspec.convert(value, StructuredOutputsField)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"Invalid {param}: {exc}", param) from None
    constraint = {key: getattr(field, key) for key in CONSTRAINT_KEYS if getattr(field, key) not in (None, False)}
    if len(constraint) != 1:
        raise APIError(400, f"{param} must set exactly one of " + ", ".join(CONSTRAINT_KEYS), param)
    return StructuredOutputsParams(**constraint)


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError(400, "response_format must be an object with a `type`", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(
                400,
                "response_format of type json_schema needs `json_schema.schema`, an object",
                "response_format.json_schema",
            )
        return StructuredOutputsParams(json=spec["schema"])
    if kind == "structural_tag":
        tag = {k: v for k, v in value.items() if k != "type"}
        return StructuredOutputsParams(structural_tag=tag)
    raise APIError(
        400,
        f"response_format type {kind!r} is not supported (text, json_object, json_schema, structural_tag)",
        "response_format.type",
    )


def _from_structured_outputs(value: Any) -> StructuredOutputsParams:
    params = _convert(value, "structured_outputs")
    field = msgspec.convert(value, StructuredOutputsField)
    if field.backend not in BACKENDS:
        raise APIError(
            400,
            f"structured_outputs backend {field.backend!r} is not available: this server uses llguidance",
            "structured_outputs.backend",
        )
    if field.disable_additional_properties:
        raise APIError(
            400,
            "disable_additional_properties is not implemented; set `additionalProperties: false` in the schema",
            "structured_outputs.disable_additional_properties",
        )
    return params


def check_structured_outputs(params: StructuredOutputsParams, param: str, max_bytes: int) -> StructuredOutputsParams:
    """The constraint as the engine gets it: a JSON schema without its annotations (descriptions, titles, examples:
    no grammar reads them). 400 naming `param` when it is larger than `max_bytes` (--max-structured-outputs-bytes),
    does not compile, or cannot travel to the engine (msgpack holds integers from -2**63 to 2**64 - 1; a schema may
    hold any). Run it on a worker thread: compiling takes up to milliseconds for large schemas."""
    params = _without_annotations(params, param)
    try:
        size = len(encode(params))
    except (OverflowError, TypeError, ValueError) as exc:
        raise APIError(400, f"Invalid {param}: {exc}", param) from None
    if size > max_bytes:
        raise APIError(
            400,
            f"The {param} constraint is {size} bytes (descriptions and titles aside), more than this server's limit "
            f"of {max_bytes} bytes (--max-structured-outputs-bytes).",
            param,
        )
    try:
        validate(params)
    except GrammarError as exc:
        raise APIError(400, f"Invalid {param}: {exc}", param) from None
    return params


def _without_annotations(params: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """`params` with its JSON schema stripped of annotations, in the form it came (an object, or JSON text)."""
    if params.json is None:
        return params
    if isinstance(params.json, dict):
        return msgspec.structs.replace(params, json=without_annotations(params.json))
    try:
        schema = json.loads(params.json)
    except ValueError as exc:
        raise APIError(400, f"Invalid {param}: the JSON schema is not JSON: {exc}", param) from None
    return msgspec.structs.replace(params, json=json.dumps(without_annotations(schema)))


async def structured_outputs_params(ctx: Any, request: Any) -> StructuredOutputsParams | None:
    """The request's constraint, validated off the event loop; None when it sets none."""
    return await checked_constraint(ctx, requested_structured_outputs(request))


async def checked_constraint(
    ctx: Any, found: tuple[StructuredOutputsParams, str] | None
) -> StructuredOutputsParams | None:
    """A (constraint, field) pair's constraint, validated on a template thread (a 400 naming the field)."""
    if found is None:
        return None
    params, source = found
    checked: StructuredOutputsParams = await ctx.offload.render(
        check_structured_outputs, params, source, ctx.config.server.max_structured_outputs_bytes
    )
    return checked
