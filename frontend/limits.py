"""The request limits that are server flags (`ServerConfig.max_*`): past one, a 400 naming the field and the limit.

`n`, completions `logprobs` / chat `top_logprobs` and `prompt_logprobs` (all --max-logprobs), the number and length
of `stop` strings, `stop_token_ids` and `logit_bias` entries, the bytes of `cache_salt`, the nesting depth of the
free-form JSON fields (tools, tool_choice, chat_template_kwargs, structured-output schemas, a message's tool_calls),
and, once the prompts are tokenized, the values a request's prompt logprobs carry (prompt tokens x (k + 1) x n).
msgspec bounds the integers while decoding (`frontend/protocol.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.config import ServerConfig
from tokenmill.frontend.errors import APIError
from tokenmill.messages import SamplingParams

FREE_FORM_FIELDS = (
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "response_format",
    "structured_outputs",
    "guided_json",
)


def _at_most(value: int, limit: int, param: str, what: str, flag: str) -> None:
    if value > limit:
        raise APIError(400, f"{what} is {value}, more than this server's limit of {limit} ({flag}).", param)


def check_sampling_limits(request: Any, limits: ServerConfig, *, logprobs: int | None, logprobs_param: str) -> None:
    """The limits of a completions or chat request (a SamplingRequest)."""
    _at_most(request.n, limits.max_n, "n", "n", "--max-n")
    if logprobs is not None:
        _at_most(logprobs, limits.max_logprobs, logprobs_param, logprobs_param, "--max-logprobs")
    if getattr(request, "prompt_logprobs", None) is not None:
        _at_most(request.prompt_logprobs, limits.max_logprobs, "prompt_logprobs", "prompt_logprobs", "--max-logprobs")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    _at_most(len(stops), limits.max_stop_strings, "stop", "The number of stop strings", "--max-stop-strings")
    longest = max(map(len, stops), default=0)
    _at_most(
        longest,
        limits.max_stop_string_chars,
        "stop",
        "The longest stop string's length in characters",
        "--max-stop-string-chars",
    )
    _at_most(
        len(request.stop_token_ids or []),
        limits.max_stop_token_ids,
        "stop_token_ids",
        "The number of stop_token_ids",
        "--max-stop-token-ids",
    )
    _at_most(
        len(request.logit_bias or {}),
        limits.max_logit_bias,
        "logit_bias",
        "The number of logit_bias entries",
        "--max-logit-bias",
    )
    check_cache_salt(request.cache_salt, limits)
    check_json_depth(request, limits.max_json_depth)


def check_cache_salt(cache_salt: str | None, limits: ServerConfig) -> None:
    """A 400 when `cache_salt` is longer than --max-cache-salt-bytes in UTF-8 (a character is at least a byte, so a
    salt with too many characters is refused before it is encoded)."""
    limit = limits.max_cache_salt_bytes
    if cache_salt is not None and (len(cache_salt) > limit or len(cache_salt.encode()) > limit):
        raise APIError(
            400,
            f"cache_salt is longer than this server's limit of {limit} bytes (--max-cache-salt-bytes).",
            "cache_salt",
        )


def check_prompt_logprobs_budget(
    prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], n: int, limits: ServerConfig
) -> None:
    """A 400 naming `prompt_logprobs` when the request's prompt logprobs would carry more values than
    --max-prompt-logprobs-elements: every prompt token's logprob and top k, for each of the n choices."""
    elements = sum(
        len(prompt) * (p.prompt_logprobs + 1) * n for prompt, p in zip(prompts, params) if p.prompt_logprobs is not None
    )
    _at_most(
        elements,
        limits.max_prompt_logprobs_elements,
        "prompt_logprobs",
        "prompt tokens x (prompt_logprobs + 1) x n",
        "--max-prompt-logprobs-elements",
    )


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
