"""/rerank, /v1/rerank, /v2/rerank, /score, /v1/score, /classify and /v1/classify on sequence-classifier instances
(`--task score` or `classify`), in vLLM's request and response shapes (`frontend/score_protocol.py`).

Each pair (query and document, text_1 and text_2) or text becomes its own engine request, tokenized as the model's
text pair (`frontend/score_pairs.py`); all are sent before any is awaited, so the scheduler packs them into the same
steps. The worker answers with the activated logits as float32 (`workers/scoring_runner.py`): the score
sentence-transformers' CrossEncoder.predict gives for /rerank and /score, label probabilities for /classify.
Inputs are bounded (texts per call, characters per text, tokens per pair: a 400 naming the field); an instance of
another task answers these paths with a 400 naming its own task.
"""

from __future__ import annotations

import functools
import time
from typing import Literal

import numpy as np
from aiohttp import web
from msgspec import UNSET

from tokenmill.frontend.context import ServingContext, new_request_id, read_body
from tokenmill.frontend.errors import APIError
from tokenmill.frontend.protocol import decode_request, encode_json, now
from tokenmill.frontend.score_pairs import (
    EncodedPair,
    PairingError,
    encode_pairs,
    encode_single_texts,
    score_pairs,
)
from tokenmill.frontend.score_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from tokenmill.frontend.serving_embeddings import EmbeddingServing
from tokenmill.messages import EngineRequest, SamplingParams
from tokenmill.score_config import ScoreConfig, load_score_config

MAX_TEXTS = 1024  # documents, pairs or inputs per call
MAX_TEXT_CHARS = 100_000  # per text, checked before tokenizing
_NO_SAMPLING = SamplingParams(max_tokens=None)  # pooling requests generate nothing
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
SCORE_PATHS = ("/score", "/v1/score")
CLASSIFY_PATHS = ("/classify", "/v1/classify")


def add_score_routes(app: web.Application, ctx: ServingContext) -> None:
    """The classifier endpoints; on an instance of another task each answers a 400 naming that task."""
    serving = ScoreServing(ctx)
    for paths, handler in (
        (RERANK_PATHS, serving.rerank),
        (SCORE_PATHS, serving.score),
        (CLASSIFY_PATHS, serving.classify),
    ):
        for path in paths:
            app.router.add_post(path, handler)


class ScoreServing:
    """The classifier handlers of one app. The model's head config is read on first use."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.pooling = EmbeddingServing(ctx)  # drives pooling requests; reads truncate_prompt_tokens

    @functools.cached_property
    def head(self) -> ScoreConfig:
        model = self.ctx.config.model
        return load_score_config(model.path, model.hf_overrides)

    async def rerank(self, http_request: web.Request) -> web.Response:
        received_at = time.monotonic()
        request: RerankRequest = await self._decode(http_request, RerankRequest)
        self._require_single_label(http_request.path)
        documents = [doc if isinstance(doc, str) else doc.text for doc in request.documents]
        _check_texts([request.query], "query")
        _check_texts(documents, "documents")
        pairs = [(request.query, document) for document in documents]
        encoded = await self._encode(encode_pairs, pairs, request.truncate_prompt_tokens, "documents")
        base_id = new_request_id("rerank")
        answers = await self._run(encoded, "score", base_id, request.priority, received_at)
        scores = [float(values[0]) for values in answers]
        ranked = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)  # stable: ties by index
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=documents[i]) if request.return_documents else UNSET,
            )
            for i in ranked[: request.top_n or None]
        ]
        response = RerankResponse(
            id=base_id,
            model=self.ctx.model_name,
            usage=RerankUsage(total_tokens=sum(len(item.token_ids) for item in encoded)),
            results=results,
        )
        return web.Response(body=encode_json(response), content_type="application/json")

    async def score(self, http_request: web.Request) -> web.Response:
        received_at = time.monotonic()
        request: ScoreRequest = await self._decode(http_request, ScoreRequest)
        self._require_single_label(http_request.path)
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except PairingError as exc:
            raise APIError(400, str(exc), exc.param) from None
        _check_texts([pair[0] for pair in pairs], "text_1")
        _check_texts([pair[1] for pair in pairs], "text_2")
        encoded = await self._encode(encode_pairs, pairs, request.truncate_prompt_tokens, "text_2")
        base_id = new_request_id("score")
        values = await self._run(encoded, "score", base_id, request.priority, received_at)
        num_tokens = sum(len(item.token_ids) for item in encoded)
        response = ScoreResponse(
            id=base_id,
            created=now(),
            model=self.ctx.model_name,
            data=[ScoreData(index=i, score=float(v[0])) for i, v in enumerate(values)],
            usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return web.Response(body=encode_json(response), content_type="application/json")

    async def classify(self, http_request: web.Request) -> web.Response:
        received_at = time.monotonic()
        request: ClassificationRequest = await self._decode(http_request, ClassificationRequest)
        texts = [request.input] if isinstance(request.input, str) else list(request.input)
        _check_texts(texts, "input")
        encoded = await self._encode(encode_single_texts, texts, request.truncate_prompt_tokens, "input")
        base_id = new_request_id("classify")
        probs = await self._run(encoded, "classify", base_id, request.priority, received_at)
        labels = self.head.labels
        num_tokens = sum(len(item.token_ids) for item in encoded)
        response = ClassificationResponse(
            id=base_id,
            created=now(),
            model=self.ctx.model_name,
            data=[
                ClassificationData(index=i, label=labels[int(np.argmax(p))], probs=p.tolist(), num_classes=len(p))
                for i, p in enumerate(probs)
            ],
            usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return web.Response(body=encode_json(response), content_type="application/json")

    # ------------------------------------------------------------------ shared steps

    async def _decode(self, http_request: web.Request, request_type: type):
        self.ctx.require_task("score", http_request)
        request = decode_request(await read_body(http_request), request_type)
        self.ctx.check_model(request.model)
        return request

    def _require_single_label(self, path: str) -> None:
        if self.head.num_labels != 1:
            raise APIError(
                400,
                f"{path} needs a model with one label (a relevance score); this one has {self.head.num_labels} "
                "labels: use /classify",
            )

    async def _encode(self, encode, items: list, truncate_prompt_tokens: int | None, param: str) -> list[EncodedPair]:
        """Token ids of each pair or text (on the tokenizer thread), each checked against max_model_len."""
        ctx = self.ctx
        max_length = self.pooling.truncation(truncate_prompt_tokens)
        encoded: list[EncodedPair] = await ctx.offload.tokenize(encode, ctx.tokenizer, items, max_length)
        for item in encoded:
            if len(item.token_ids) > ctx.max_model_len:
                raise APIError(
                    400,
                    f"This model's maximum context length is {ctx.max_model_len} tokens. However, an input has "
                    f"{len(item.token_ids)} tokens. Please reduce the length of the input, or set "
                    "truncate_prompt_tokens.",
                    param,
                )
        return encoded

    async def _run(
        self,
        encoded: list[EncodedPair],
        task: Literal["score", "classify"],
        base_id: str,
        priority: int,
        received_at: float,
    ) -> list[np.ndarray]:
        """Each item's float32 answer, in order: one request per item, all sent at once."""
        ctx = self.ctx
        ctx.admission.check(ctx.engine, len(encoded))
        arrival = time.time()
        requests = [
            EngineRequest(
                request_id=f"{base_id}-{i}",
                prompt_token_ids=item.token_ids,
                sampling=_NO_SAMPLING,
                task=task,
                arrival_time=arrival,
                priority=priority,
                second_segment_start=item.second_segment_start,
            )
            for i, item in enumerate(encoded)
        ]
        outputs = await self.pooling.run_all(requests, received_at)
        return [np.frombuffer(out.embedding or b"", dtype="<f4") for out in outputs]


def _check_texts(texts: list[str], param: str) -> None:
    if not texts:
        raise APIError(400, f"{param} must not be empty", param)
    if len(texts) > MAX_TEXTS:
        raise APIError(400, f"{param} holds {len(texts)} texts; at most {MAX_TEXTS} are allowed per request", param)
    longest = max(len(text) for text in texts)
    if longest > MAX_TEXT_CHARS:
        message = f"{param} holds a text of {longest} characters; at most {MAX_TEXT_CHARS} are allowed"
        raise APIError(400, message, param)
    if any(not text for text in texts):
        raise APIError(400, f"{param} must not contain an empty string", param)
