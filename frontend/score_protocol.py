"""Request and response schemas of the sequence-classifier endpoints, in vLLM's shapes (its `protocol.py`):
/rerank (also Jina's and Cohere's: `documents` as strings or `{"text": ...}` objects, `top_n`, `return_documents`),
/score (`text_1`, `text_2`) and /classify (`input`). Decoded with `protocol.decode_request`, which names the field
of any type error."""

from __future__ import annotations

from typing import Annotated

from msgspec import UNSET, Meta, Struct, UnsetType

from tokenmill.frontend.protocol import INT64_MAX, Int64, NonNegativeInt

TruncatePromptTokens = Annotated[int, Meta(ge=-1, le=INT64_MAX)]  # last N tokens; -1: max_model_len


class RerankDocument(Struct, kw_only=True):
    text: str


class RerankRequest(Struct, kw_only=True):
    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: NonNegativeInt | None = None  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    priority: Int64 = 0


class RerankResult(Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | UnsetType = UNSET  # absent with return_documents: false


class RerankUsage(Struct, kw_only=True):
    total_tokens: int


class RerankResponse(Struct, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(Struct, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    priority: Int64 = 0


class ScoreData(Struct, kw_only=True):
    index: int
    object: str = "score"
    score: float


class PoolingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class ClassificationRequest(Struct, kw_only=True):
    input: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    priority: Int64 = 0


class ClassificationData(Struct, kw_only=True):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
