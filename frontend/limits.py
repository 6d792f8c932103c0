"""The request limits that are server flags (`ServerConfig.max_*`): past one, a 400 naming the field and the limit.

`n`, completions `logprobs` / chat `top_logprobs` and `prompt_logprobs` (all --max-logprobs), the number and length
of `stop` strings, `stop_token_ids` and `logit_bias` entries, and the nesting depth of the free-form JSON fields
(tools, tool_choice, chat_template_kwargs, structured-output schemas, a message's tool_calls). msgspec bounds the
integers while decoding (`frontend/protocol.py`).
"""

from __future__ import annotations

from typing import Any

from tokenmill.config import ServerConfig
from tokenmill.frontend.errors import APIError

FREE_FORM_FIELDS = ("tools", "tool_choice", "chat_template_kwargs", "response_format", "structured_outputs",
                    "guided_json")


def _at_most(value: int, limit: int, param: str, what: str, flag: str) -> None:
    if value > limit:
        raise APIError(400, f"{what} is {value}, more than this server's limit of {limit} ({flag}).", param)


def check_sampling_limits(request: Any, limits: ServerConfig, *, logprobs: int | None,
                          logprobs_param: str) -> None:
    """The limits of a completions or chat request (a SamplingRequest)."""
    _at_most(request.n, limits.max_n, "n", "n", "--max-n")
    if logprobs is not None:
        _at_most(logprobs, limits.max_logprobs, logprobs_param, logprobs_param, "--max-logprobs")
    if getattr(request, "prompt_logprobs", None) is not None:
        _at_most(request.prompt_logprobs, limits.max_logprobs, "prompt_logprobs", "prompt_logprobs", "--max-logprobs")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    _at_most(len(stops), limits.max_stop_strings, "stop", "The number of stop strings", "--max-stop-strings")
    longest = max(map(len, stops), default=0)
    _at_most(longest, limits.max_stop_string_chars, "stop", "The longest stop string's length in characters",
             "--max-stop-string-chars")
    _at_most(len(request.stop_token_ids or []), limits.max_stop_token_ids, "stop_token_ids",
             "The number of stop_token_ids", "--max-stop-token-ids")
    _at_most(len(request.logit_bias or {}), limits.max_logit_bias, "logit_bias", "The number of logit_bias entries",
             "--max-logit-bias")
    check_json_depth(request, limits.max_json_depth)


def check_json_depth(request: Any, max_depth: int) -> None:
    """A 400 when a free-form field nests deeper than `max_depth` (a scalar is depth 0, `[1]` depth 1)."""
    values = [(field, getattr(request, field, None)) for field in FREE_FORM_FIELDS]
    for i, message in enumerate(getattr(request, "messages", None) or []):
        values.append((f"messages[{i}].tool_calls", getattr(message, "tool_calls", None)))
    for param, value in values:
        if json_depth_exceeds(value, max_depth):
            raise APIError(400, f"{param} is nested more than {max_depth} levels deep (--max-json-depth).", param)


def json_depth_exceeds(value: Any, max_depth: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
