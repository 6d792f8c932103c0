"""Run the engine requests behind a response's choices and turn their outputs into text deltas.

Each choice is one EngineRequest (a prompt times `n`). `stream_choice` drives one through the engine: incremental
detokenization, stop strings (a match ends the choice and aborts the engine request), per-request metrics, and an
abort whenever the choice ends before the engine finished it (client gone, error, cancellation). `merge_choice_streams`
interleaves several choices as their outputs arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.engine_client import EngineDeadError
from tokenmill.frontend.engine_protocol import EngineClient
from tokenmill.frontend.errors import APIError, engine_rejection
from tokenmill.frontend.metrics import FrontendMetrics
from tokenmill.frontend.outputs import ChoiceDelta, next_delta
from tokenmill.frontend.protocol import PromptTokensDetails, UsageInfo
from tokenmill.frontend.tracing import current_trace
from tokenmill.messages import EngineRequest, LoRARequest, RequestOutput, SamplingParams, choice_requests

log = logging.getLogger("tokenmill.frontend")


@dataclass
class Choice:
    """One choice of a response: its engine request, detokenizer and running counts."""

    index: int
    prompt_index: int
    group: EngineRequest  # the engine request of its prompt, all n choices in one
    request: EngineRequest  # this choice's part of it, as the scheduler runs it
    detokenizer: IncrementalDetokenizer
    received_at: float  # time.monotonic() when the HTTP request came in: latencies count from there
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    started: bool = False  # the engine has produced output for it


def request_deadline(received_at: float, timeout: float | None, server_timeout: float) -> float:
    """When (time.monotonic()) a request received at `received_at` ends with what it has: its own `timeout`, capped by
    --request-timeout; 0 when neither is set. The scheduler enforces it (EngineRequest.deadline)."""
    limits = [t for t in (timeout, server_timeout) if t]
    return received_at + min(limits) if limits else 0.0


def build_choices(
    tokenizer: Any,
    base_id: str,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    n: int,
    *,
    received_at: float,
    priority: int = 0,
    cache_salt: str | None = None,
    deadline: float = 0.0,
    lora_request: LoRARequest | None = None,
) -> list[Choice]:
    """n choices per prompt, indexed prompt-major as OpenAI orders them. Each prompt is one engine request
    `{base_id}-{prompt_index}` (one message, one copy of its prompt and params, whatever n is); its choices are that
    request's `choice_requests` (ids `{request id}-{i}` when n > 1; a seeded request's choice i gets seed + i).

    Stop strings are matched here, by each choice's detokenizer, so the engine's copy of the params leaves them out."""
    choices: list[Choice] = []
    arrival = time.time()
    for prompt_index, (prompt_ids, prompt_params) in enumerate(zip(prompts, params)):
        engine_params = msgspec.structs.replace(prompt_params, n=n, stop=[])
        group = EngineRequest(
            request_id=f"{base_id}-{prompt_index}",
            prompt_token_ids=prompt_ids,
            sampling=engine_params,
            arrival_time=arrival,
            priority=priority,
            cache_salt=cache_salt,
            deadline=deadline,
            lora_request=lora_request,
        )
        for i, request in enumerate(choice_requests(group)):
            choices.append(
                Choice(
                    prompt_index * n + i,
                    prompt_index,
                    group,
                    request,
                    IncrementalDetokenizer(tokenizer, prompt_ids, prompt_params),
                    received_at,
                )
            )
    return choices


def usage_info(choices: Sequence[Choice]) -> UsageInfo:
    """Token counts of a response: each prompt counted once however many choices it has; prefix-cache hits always
    reported (`prompt_tokens_details.cached_tokens`, OpenAI's shape), 0 included, as billing reads them."""
    prompt_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    for choice in choices:
        prompt_tokens[choice.prompt_index] = len(choice.request.prompt_token_ids)
        cached_tokens[choice.prompt_index] = max(cached_tokens.get(choice.prompt_index, 0), choice.num_cached_tokens)
    num_prompt = sum(prompt_tokens.values())
    num_completion = sum(choice.num_generated_tokens for choice in choices)
    num_cached = sum(cached_tokens.values())
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(num_cached),
    )


class AdmissionControl:
    """Counts requests sent to the engine that have not produced output yet, for the 429 check: the scheduler's
    `num_waiting` lags a step behind and misses requests still in flight to it."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.num_pending = 0

    def check(self, engine: EngineClient, num_new: int) -> None:
        """Raise 503 when the engine is dead, 429 (with Retry-After) when the queue is full."""
        dead_reason = engine.dead_reason
        if dead_reason is not None:
            raise APIError(503, f"The engine stopped: {dead_reason}.")
        stats = engine.latest_stats
        waiting = max(stats.num_waiting if stats is not None else 0, self.num_pending)
        if waiting + num_new > self.max_waiting:
            raise engine_rejection(
                f"The server is busy: {waiting} requests are waiting (limit {self.max_waiting}). Retry later.",
                "overloaded",
            )


async def run_choices(
    engine: EngineClient, choices: Sequence[Choice], metrics: FrontendMetrics, admission: AdmissionControl
) -> AsyncIterator[ChoiceDelta]:
    """Send each prompt's engine request once and yield every choice's deltas as they arrive (`merge_choice_streams`).
    Leaving early aborts whatever the engine has not finished."""
    async with contextlib.AsyncExitStack() as groups:
        outputs: dict[str, AsyncIterator[RequestOutput]] = {}
        try:
            for group in {id(c.group): c.group for c in choices}.values():
                streams = await groups.enter_async_context(engine.generate_choices(group))
                outputs.update(zip((c.request_id for c in choice_requests(group)), streams))
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from exc
        trace = current_trace.get()
        if trace is not None:
            trace.engine_started(list(choices))
        streams = [stream_choice(engine, c, outputs[c.request.request_id], metrics, admission) for c in choices]
        async with aclosing(merge_choice_streams(streams)) as deltas:
            async for delta in deltas:
                yield delta


async def stream_choice(
    engine: EngineClient,
    choice: Choice,
    engine_outputs: AsyncIterator[RequestOutput],
    metrics: FrontendMetrics,
    admission: AdmissionControl,
) -> AsyncIterator[ChoiceDelta]:
    """Yield the choice's deltas; the last has finish_reason. Raises APIError: 400 for a request the engine rejects
    (429 with Retry-After when it is overloaded), 503 when the engine has died."""
    request = choice.request
    arrival = choice.received_at
    last_output_time = arrival
    trace = current_trace.get()  # the request's span, when tracing is on (frontend/tracing.py)
    engine_done = False
    admission.num_pending += 1
    try:
        async with aclosing(engine_outputs) as outputs:
            async for out in outputs:
                if out.error is not None:
                    engine_done = True
                    raise engine_rejection(out.error, out.error_kind)
                now = time.monotonic()
                if not choice.started:
                    choice.started = True
                    admission.num_pending -= 1
                    metrics.time_to_first_token.observe(now - arrival)
                    if trace is not None:
                        trace.first_token(now)
                    metrics.prompt_tokens.inc(len(request.prompt_token_ids))
                    metrics.request_prompt_tokens.observe(len(request.prompt_token_ids))
                else:
                    metrics.inter_token_latency.observe(now - last_output_time)
                last_output_time = now
                choice.num_generated_tokens += len(out.new_token_ids)
                choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
                metrics.generation_tokens.inc(len(out.new_token_ids))
                engine_done = out.finish_reason is not None
                if out.finish_reason == "error":
                    raise APIError(500, "The engine failed while generating this request.")
                delta = next_delta(choice.index, choice.detokenizer, out)
                finish_reason = delta.finish_reason
                if finish_reason is not None:
                    metrics.e2e_request_latency.observe(now - arrival)
                    metrics.record_finished(finish_reason)
                    if trace is not None:
                        trace.choice_finished(finish_reason, out.queue_time_s)
                yield delta
                if finish_reason is not None:
                    return
        engine_done = True
        raise APIError(500, "The engine ended the request without a finish reason.")
    except EngineDeadError as exc:
        engine_done = True
        raise APIError(503, str(exc)) from exc
    finally:
        if not choice.started:
            admission.num_pending -= 1
            choice.started = True
        if not engine_done:
            await _abort_quietly(engine, request.request_id)


async def _abort_quietly(engine: EngineClient, request_id: str) -> None:
    try:
        await engine.abort([request_id])
    except Exception:  # the engine may be dead already; nothing is left to free then
        log.debug("abort of %s failed", request_id, exc_info=True)


_STREAM_DONE = object()


async def merge_choice_streams(streams: Sequence[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Interleave the choices' deltas as they arrive. The first error ends the merge and every other choice (each
    then aborts its engine request)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    queue.put_nowait(delta)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_STREAM_DONE)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is _STREAM_DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
