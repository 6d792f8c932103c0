"""OpenAI and vLLM request fields tokenmill does not implement: a request that uses one gets a 400 naming it, rather
than an answer that silently ignores it.

A field counts as used when it holds anything but its no-op value: null, false, an empty list or object, `best_of`
1, `modalities` ["text"]. Fields no schema declares are still ignored (`frontend/protocol.py`). Tool calling
(`tools`, `tool_choice`, `parallel_tool_calls`) is checked in `frontend/tool_choice.py`; OpenAI's deprecated
`functions` / `function_call` are refused here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenmill.frontend.errors import APIError


def _set(value: Any, request: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {} and value != ""


def _not(*no_ops: Any) -> Callable[[Any, Any], bool]:
    return lambda value, request: _set(value, request) and value not in no_ops


# field -> (is it used?, what tokenmill would need for it)
RULES: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "best_of": (_not(1), "best_of is not implemented; use n"),
    "suffix": (_set, "suffix (insertion) is not implemented"),
    "use_beam_search": (_set, "beam search is not implemented"),
    "truncate_prompt_tokens": (_set, "prompt truncation is implemented for /v1/embeddings only"),
    "allowed_token_ids": (_set, "allowed_token_ids is not implemented; logit_bias can do the same"),
    "bad_words": (_set, "bad_words is not implemented"),
    "functions": (_set, "the deprecated `functions` are not implemented; use `tools`"),
    "function_call": (_not("none"), "the deprecated `function_call` is not implemented; use `tool_choice`"),
    "audio": (_set, "audio output is not implemented"),
    "modalities": (_not(["text"]), "only text output is implemented"),
    "prediction": (_set, "predicted outputs are not implemented"),
    "web_search_options": (_set, "web search is not implemented"),
    "documents": (_set, "documents (RAG) are not passed to the chat template"),
}


def refuse_unsupported(request: Any, rules: dict[str, tuple[Callable[[Any, Any], bool], str]] = RULES) -> None:
    """A 400 naming the first field the request uses that tokenmill does not implement (by `rules`: chat and
    completions use RULES; /v1/responses has its own, in frontend/responses_protocol.py)."""
    for field in getattr(request, "__struct_fields__", ()):
        rule = rules.get(field)
        if rule is not None and rule[0](getattr(request, field), request):
            raise APIError(400, f"`{field}` is not supported by this server: {rule[1]}.", field)
