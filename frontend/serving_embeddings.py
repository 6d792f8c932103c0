"""POST /v1/embeddings on embedding instances: inputs (text or token ids, one or many) in, OpenAI's list of vectors out.

Every input of a call becomes its own engine request (task "embed"); they are all sent before any result is awaited,
so the scheduler packs them into the same steps, and the response lists them in input order. The engine returns
each vector as raw float32 bytes; `dimensions` (Matryoshka) keeps the first N features and re-normalizes them when
the model normalizes, and `encoding_format="base64"` sends the little-endian float32 bytes base64-encoded, as OpenAI
does (the official Python client asks for base64 by default and decodes it).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import time
from contextlib import aclosing

import numpy as np
from aiohttp import web

from tokenmill.frontend.context import ServingContext, new_request_id, read_body
from tokenmill.frontend.engine_client import EngineDeadError
from tokenmill.frontend.errors import APIError, engine_rejection
from tokenmill.frontend.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    decode_request,
    encode_json,
    now,
)
from tokenmill.frontend.tokenizer import encode_text_keep_last, encode_texts
from tokenmill.messages import EngineRequest, RequestOutput, SamplingParams
from tokenmill.pooling_config import PoolingConfig, check_dimensions, load_pooling_config

MAX_INPUTS = 2048  # OpenAI's limit on inputs per call
EMBEDDING_DTYPE = np.dtype("<f4")
_NO_SAMPLING = SamplingParams(max_tokens=None)  # embedding requests generate nothing


def encode_inputs(tokenizer, texts: list[str], add_special_tokens: bool, keep_last: int | None) -> list[list[int]]:
    """The ids of each text, the last `keep_last` of them when set (on the tokenizer thread)."""
    if keep_last is None:
        return encode_texts(tokenizer, texts, add_special_tokens)
    return [encode_text_keep_last(tokenizer, text, add_special_tokens, keep_last) for text in texts]


class EmbeddingServing:
    """The /v1/embeddings handler of one app. The model's pooling files and hidden size are read on first use."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    @functools.cached_property
    def pooling(self) -> PoolingConfig:
        model = self.ctx.config.model
        return load_pooling_config(model.path, model.architecture, model.pooling, model.normalize)

    async def create_embedding(self, http_request: web.Request) -> web.Response:
        received_at = time.monotonic()
        ctx = self.ctx
        ctx.require_task("embed", http_request)
        request: EmbeddingRequest = decode_request(await read_body(http_request), EmbeddingRequest)
        ctx.check_base_model(request.model)
        prompts = await self.embedding_inputs(request)
        if request.dimensions is not None:
            self.check_dimensions(request.dimensions)
        ctx.admission.check(ctx.engine, len(prompts))
        base_id = new_request_id("embd")
        arrival = time.time()
        requests = [
            EngineRequest(
                request_id=f"{base_id}-{i}",
                prompt_token_ids=ids,
                sampling=_NO_SAMPLING,
                task="embed",
                arrival_time=arrival,
                priority=request.priority,
            )
            for i, ids in enumerate(prompts)
        ]
        outputs = await self.run_all(requests, received_at)
        data = [EmbeddingData(index=i, embedding=self.render(out.embedding, request)) for i, out in enumerate(outputs)]
        num_tokens = sum(len(ids) for ids in prompts)
        response = EmbeddingResponse(
            id=base_id,
            created=now(),
            model=ctx.model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return web.Response(body=encode_json(response), content_type="application/json")

    # ------------------------------------------------------------------ validation

    async def embedding_inputs(self, request: EmbeddingRequest) -> list[list[int]]:
        """Token ids per input: a string, a list of strings, token ids, or a list of token-id lists; truncated to
        `truncate_prompt_tokens` and checked against max_model_len. Texts are tokenized on the tokenizer thread;
        an empty string is refused, as OpenAI does."""
        ctx = self.ctx
        given = request.input
        if isinstance(given, str):
            items: list = [given]
        elif not given:
            raise APIError(400, "input must not be empty", "input")
        elif all(isinstance(item, int) for item in given):
            items = [list(given)]
        elif all(isinstance(item, str) for item in given) or all(isinstance(item, list) for item in given):
            items = list(given)
        else:
            raise APIError(
                400,
                "input must be a string, a list of strings, a list of token ids, or a list of token-id lists",
                "input",
            )
        if len(items) > MAX_INPUTS:
            raise APIError(
                400, f"input holds {len(items)} items; at most {MAX_INPUTS} are allowed per request", "input"
            )
        if any(item == "" for item in items):
            raise APIError(400, "input must not contain an empty string", "input")
        keep_last = self.truncation(request.truncate_prompt_tokens)
        texts = [item for item in items if isinstance(item, str)]
        encoded = iter(
            await ctx.offload.tokenize(encode_inputs, ctx.tokenizer, texts, request.add_special_tokens, keep_last)
            if texts
            else []
        )
        prompts: list[list[int]] = []
        for item in items:
            if isinstance(item, str):
                ids = next(encoded)
            else:
                ctx.check_token_ids(item, "input")
                ids = item if keep_last is None else item[-keep_last:]
            if not ids:
                raise APIError(400, "input must not be empty (an item has no tokens)", "input")
            if len(ids) > ctx.max_model_len:
                raise APIError(
                    400,
                    f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
                    f"an input has {len(ids)} tokens. Please reduce the length of the input, or "
                    f"set truncate_prompt_tokens.",
                    "input",
                )
            prompts.append(ids)
        return prompts

    def truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many trailing tokens to keep, or None for no truncation."""
        if truncate_prompt_tokens is None:
            return None
        max_len = self.ctx.max_model_len
        if truncate_prompt_tokens == -1:
            return max_len
        if truncate_prompt_tokens == 0 or truncate_prompt_tokens > max_len:
            raise APIError(
                400,
                f"truncate_prompt_tokens must be -1 (max_model_len) or between 1 and the model's "
                f"maximum context length {max_len}, got {truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )
        return truncate_prompt_tokens

    def check_dimensions(self, dimensions: int) -> None:
        hidden_size = self.ctx.config.model.hidden_size
        allow_any = self.ctx.config.model.allow_dimensions
        try:
            check_dimensions(dimensions, hidden_size, self.pooling, allow_any)
        except ValueError as exc:
            message = str(exc)
            if not allow_any and dimensions <= hidden_size:  # refused for the model, not for the number
                message += " (start the server with --allow-dimensions to truncate anyway)"
            raise APIError(400, message, "dimensions") from None

    # ------------------------------------------------------------------ the engine

    async def run_all(self, requests: list[EngineRequest], received_at: float) -> list[RequestOutput]:
        """Each request's final output, in order. The first failure cancels (and so aborts) the others."""
        tasks = [asyncio.create_task(self.run_one(request, received_at)) for request in requests]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_one(self, request: EngineRequest, received_at: float) -> RequestOutput:
        ctx = self.ctx
        ctx.admission.num_pending += 1
        try:
            async with aclosing(ctx.engine.generate(request)) as outputs:
                async for out in outputs:
                    if out.error is not None:
                        raise engine_rejection(out.error, out.error_kind, "input")
                    if out.finish_reason is None:
                        continue
                    if out.embedding is None:
                        raise APIError(
                            500, f"The engine ended an embedding request with '{out.finish_reason}' and no embedding."
                        )
                    num_prompt = len(request.prompt_token_ids)
                    ctx.metrics.prompt_tokens.inc(num_prompt)
                    ctx.metrics.request_prompt_tokens.observe(num_prompt)
                    ctx.metrics.e2e_request_latency.observe(time.monotonic() - received_at)
                    ctx.metrics.record_finished(out.finish_reason)
                    return out
            raise APIError(500, "The engine ended an embedding request without a result.")
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from exc
        finally:
            ctx.admission.num_pending -= 1

    # ------------------------------------------------------------------ output

    def render(self, raw: bytes, request: EmbeddingRequest) -> list[float] | str:
        vector = np.frombuffer(raw, dtype=EMBEDDING_DTYPE)
        if request.dimensions is not None and request.dimensions < vector.shape[0]:
            vector = vector[: request.dimensions]
            if self.pooling.normalize:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        if request.encoding_format == "base64":
            return base64.b64encode(vector.astype(EMBEDDING_DTYPE, copy=False).tobytes()).decode("ascii")
        return vector.tolist()
