"""A fake engine, an `EngineClient` (frontend/engine_protocol.py), for testing the HTTP frontend without a model.

By default it echoes each request's prompt tokens back, one per step; `replies` scripts the output tokens of the next
requests instead. It finishes like the scheduler does: a stop id or EOS ends with "stop" (the id is the last new
token and `stop_token_id`), `max_tokens` with "length". `hold=True` makes requests wait after their first token
until aborted (for disconnect tests). A request that asks for prompt logprobs gets `fake_prompt_logprobs` with its first
output.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.frontend.engine_client import EngineDeadError
from tokenmill.frontend.engine_protocol import ReplicaStats
from tokenmill.messages import (
    EngineReady,
    EngineRequest,
    PromptLogprobs,
    RequestOutput,
    SchedulerStats,
    StepSummary,
    choice_requests,
)
from tokenmill.scheduler.scheduler import Rejection


def rejected(request_id: str, reason: str | Rejection) -> RequestOutput:
    """The output the scheduler process publishes for a refused request (a plain string is an "invalid" one)."""
    rejection = reason if isinstance(reason, Rejection) else Rejection(reason)
    return RequestOutput(request_id, [], finish_reason="error", error=rejection.message, error_kind=rejection.kind)


EOS_ID = 2


def fake_prompt_logprobs(request: EngineRequest) -> PromptLogprobs | None:
    """What the fake engine reports when a request asks for prompt logprobs: for prompt token t at position p >= 1,
    logprob -0.5 at rank 2, behind t + 1 (-0.25), then t (-0.5) and t + 2 (-3.0) in its top list."""
    k = request.sampling.prompt_logprobs
    if k is None:
        return None
    return PromptLogprobs.from_entries(
        [(-0.5, 2, [t + 1, t, t + 2][:k], [-0.25, -0.5, -3.0][:k]) for t in request.prompt_token_ids[1:]], min(k, 3)
    )


class FakeEngine:
    def __init__(self) -> None:
        self.latest_stats: SchedulerStats | None = None
        self.dead_reason: str | None = None
        self.ready: EngineReady | None = None
        self.summary_listener: Callable[[StepSummary], None] | None = None
        self.watch_intervals: list[float] = []  # every watch_steps call
        self.healthy = True
        self.requests: list[EngineRequest] = []
        self.groups: list[EngineRequest] = []  # what was sent: one request per prompt, its n choices in it
        self.aborted: list[str] = []
        self.replies: list[list[int]] = []  # output tokens of the next requests, in order
        self.reject_with: str | Rejection | None = None
        self.hold = False
        self.step_delay_s = 0.0
        self.aborted_event = asyncio.Event()

    def start(self) -> None:
        pass

    async def wait_ready(self, timeout: float | None = None) -> EngineReady:
        assert self.ready is not None, "set `ready` first"
        return self.ready

    def close(self) -> None:
        self.dead_reason = self.dead_reason or "the engine was shut down"

    @contextlib.asynccontextmanager
    async def generate_choices(self, request: EngineRequest) -> AsyncIterator[list[AsyncIterator[RequestOutput]]]:
        """As the real client: one request, a stream per choice (each recorded in `requests` as its own)."""
        self.groups.append(request)
        yield [self.generate(choice) for choice in choice_requests(request)]

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(f"The engine stopped: {self.dead_reason}.")
        self.requests.append(request)
        if self.reject_with is not None:
            yield rejected(request.request_id, self.reject_with)
            return
        params = request.sampling
        tokens = self.replies.pop(0) if self.replies else list(request.prompt_token_ids)
        ending_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS_ID})
        for step, token in enumerate(tokens):
            await asyncio.sleep(self.step_delay_s)
            if request.request_id in self.aborted:
                return
            if self.dead_reason is not None:
                raise EngineDeadError(f"The engine stopped: {self.dead_reason}.")
            finish, stop_id, stop_reason = None, None, None
            if token in ending_ids and step + 1 > params.min_tokens:
                finish, stop_id = "stop", token
                stop_reason = None if token == EOS_ID and not params.ignore_eos else token  # EOS first, as vLLM
            elif step + 1 == params.max_tokens or step + 1 == len(tokens):
                finish = "length"
            logprobs = None
            if params.logprobs is not None:
                top_ids = [token, token + 1, token + 2][: params.logprobs]
                logprobs = [(-0.25, top_ids, [-0.25, -1.5, -3.0][: len(top_ids)])]
            yield RequestOutput(
                request.request_id,
                [token],
                finish_reason=finish,
                stop_token_id=stop_id,
                num_prompt_tokens=len(request.prompt_token_ids),
                logprobs=logprobs,
                stop_reason=stop_reason,
                prompt_logprobs=fake_prompt_logprobs(request) if step == 0 else None,
            )
            if finish is not None:
                return
            if self.hold:
                await asyncio.Event().wait()  # until cancelled

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        self.aborted_event.set()

    async def watch_steps(self, interval_s: float) -> None:
        self.watch_intervals.append(interval_s)

    async def check_health(self) -> bool:
        return self.healthy and self.dead_reason is None

    def health_detail(self) -> dict[str, Any] | None:
        return None

    def replica_stats(self) -> list[ReplicaStats] | None:
        return None

    def routing_decisions(self) -> dict[str, list[int]]:
        return {}
