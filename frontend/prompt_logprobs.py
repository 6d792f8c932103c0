"""Prompt logprobs in vLLM's shapes, from the engine's packed arrays (`PromptLogprobs`, a row per prompt token after
the first: its logprob, its rank, the top ids and their logprobs), read into Python objects only here, as they are
formatted.

- `prompt_logprobs` (completions choices, the chat response, the offline API): a list with None for the first prompt
  token, then per token {token id: Logprob(logprob, rank, decoded_token)}: the prompt token first, then the top k
  (ranks 1..k), a token in both listed once, as vLLM builds it.
- completions `echo` with `logprobs` (OpenAI's legacy shape, what lm-eval's `local-completions` reads): the prompt
  tokens lead the choice's `logprobs`, the first with null `token_logprobs` and `top_logprobs`; their text offsets run
  from 0 over the token texts, and the generated tokens' continue from there. As vLLM, echo with `logprobs` asks the
  engine for prompt logprobs with the same k unless `prompt_logprobs` is given, and `max_tokens: 0` (echo only)
  generates one token that the response leaves out.

-inf becomes -9999.0, as vLLM writes it into JSON.

A server response formats them into JSON a slice of positions at a time (`prompt_logprobs_json`), giving the event loop
back between slices: the largest prompt the budget admits (hundreds of thousands of positions, each a dict of k + 1
entries) would otherwise hold every other stream's next chunk for as long as formatting it takes (~2 ms per thousand
values, most of it decoding token texts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
from msgspec import UNSET, UnsetType

from tokenmill.frontend.errors import APIError
from tokenmill.frontend.logprobs import TokenTexts
from tokenmill.frontend.protocol import CompletionLogProbs, CompletionRequest, Logprob, PromptLogprobs, encode_json
from tokenmill.messages import PromptLogprobs as EnginePromptLogprobs
from tokenmill.messages import PromptLogprobsEntry

MIN_LOGPROB = -9999.0
# values (positions x (k + 1)) formatted between two turns of the event loop: ~1-3 ms of work
FORMAT_SLICE_VALUES = 1024


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _position_dict(token_id: int, entry: PromptLogprobsEntry, texts: TokenTexts) -> dict[int, Logprob]:
    logprob, rank, top_ids, top_logprobs = entry
    position = {token_id: Logprob(logprob=_clamp(logprob), rank=rank, decoded_token=texts[token_id])}
    for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs), start=1):
        position[top_id] = Logprob(logprob=_clamp(top_logprob), rank=top_rank, decoded_token=texts[top_id])
    return position


def vllm_prompt_logprobs(
    prompt_ids: Sequence[int], engine_logprobs: EnginePromptLogprobs, texts: TokenTexts
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` list for a prompt and the engine's arrays."""
    entries = engine_logprobs.entries()
    return [None] + [_position_dict(token_id, entry, texts) for token_id, entry in zip(prompt_ids[1:], entries)]


async def prompt_logprobs_json(
    prompt_ids: Sequence[int], engine_logprobs: EnginePromptLogprobs, texts: TokenTexts
) -> msgspec.Raw:
    """`vllm_prompt_logprobs` as JSON, to embed in a response: built and encoded a slice of positions at a time,
    yielding to the event loop between slices."""
    logprobs, ranks, top_ids, top_logprobs = engine_logprobs.arrays()
    step = max(1, FORMAT_SLICE_VALUES // (engine_logprobs.num_top + 1))
    parts = [b"[null"]
    for start in range(0, engine_logprobs.num_positions, step):
        stop = start + step
        rows = zip(
            prompt_ids[start + 1 : stop + 1],
            logprobs[start:stop].tolist(),
            ranks[start:stop].tolist(),
            top_ids[start:stop].tolist(),
            top_logprobs[start:stop].tolist(),
        )
        positions = [_position_dict(token_id, (lp, rank, ids, lps), texts) for token_id, lp, rank, ids, lps in rows]
        parts.append(b"," + encode_json(positions)[1:-1])  # the slice's items, without its brackets
        await asyncio.sleep(0)
    parts.append(b"]")
    return msgspec.Raw(b"".join(parts))


# ---------------------------------------------------------------------------------------------- completions


def engine_prompt_logprobs(request: CompletionRequest) -> int | None:
    """How many top logprobs per prompt token the engine computes: `prompt_logprobs`, or with echo `logprobs`."""
    if request.prompt_logprobs is None and request.echo:
        return request.logprobs
    return request.prompt_logprobs


def engine_max_tokens(request: CompletionRequest) -> int | None:
    """The max_tokens the engine runs with: 0 is allowed with echo only (the prompt alone comes back), and the engine
    then generates one token that is not shown, as vLLM."""
    if request.max_tokens == 0:
        if not request.echo:
            raise APIError(400, "max_tokens must be at least 1, got 0 (0 is allowed only with echo).", "max_tokens")
        return 1
    return request.max_tokens


def echo_logprobs(
    prompt_ids: Sequence[int], engine_logprobs: EnginePromptLogprobs | None, num_top: int, texts: TokenTexts
) -> tuple[CompletionLogProbs, int]:
    """The prompt tokens' part of an echoed choice's completions logprobs, and the text offset after them. Each
    position's top_logprobs holds the prompt token and the first `num_top` of its top list (vLLM keeps the first
    num_top + 1 entries of the position's dict), by decoded text."""
    result = CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    entries = engine_logprobs.entries() if engine_logprobs is not None else []
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        token = texts[token_id]
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if i == 0 or i > len(entries):
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        position = _position_dict(token_id, entries[i - 1], texts)
        result.token_logprobs.append(position[token_id].logprob)
        result.top_logprobs.append({texts[top_id]: lp.logprob for top_id, lp in list(position.items())[: num_top + 1]})
    return result, offset


def join_logprobs(first: CompletionLogProbs | None, second: CompletionLogProbs | None) -> CompletionLogProbs | None:
    if first is None or second is None:
        return first or second
    return CompletionLogProbs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


# ---------------------------------------------------------------------------------------------- chat


async def response_prompt_logprobs(
    choices: Sequence, summaries: Sequence, texts: TokenTexts
) -> msgspec.Raw | UnsetType:
    """A one-prompt response's top-level `prompt_logprobs` (vLLM's chat shape) as JSON, from the first choice (a
    `Choice`) whose summary (a `CompletionOutput`) has them; UNSET when the request did not ask."""
    for summary in summaries:
        if summary.prompt_logprobs is not None:
            prompt_ids = choices[summary.index].request.prompt_token_ids
            return await prompt_logprobs_json(prompt_ids, summary.prompt_logprobs, texts)
    return UNSET
