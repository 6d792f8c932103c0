"""A request the scheduler refuses reaches the client with the scheduler's own words: 429 with Retry-After when it is
overloaded (a machine-readable kind on the RequestOutput), 400 otherwise."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.frontend_fakes import rejected
from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tokenmill.config import EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.messages import EngineRequest, SamplingParams, SchedulerMessage, StepOutputs, decoder, encode
from tokenmill.scheduler.scheduler import Rejection, Scheduler

OVERLOADED = "The server is overloaded: 7 requests are already waiting; retry later."


def test_the_schedulers_overload_reason_crosses_as_a_kind():
    config = EngineConfig(model=ModelConfig(max_model_len=64), scheduler=SchedulerConfig(max_waiting_requests=1))
    scheduler = Scheduler(config, 16, [2])
    request = EngineRequest(request_id="a", prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=2))
    assert scheduler.add_request(request) is None
    reason = scheduler.add_request(EngineRequest(request_id="b", prompt_token_ids=[5], sampling=SamplingParams()))
    assert reason.kind == "overloaded" and "overloaded" in reason.message
    # as scheduler/process.py publishes it, and as the frontend's engine client decodes it
    received = decoder(SchedulerMessage).decode(encode(StepOutputs([rejected("b", reason)]))).outputs[0]
    assert (received.error, received.error_kind) == (reason.message, "overloaded")
    scheduler.config = EngineConfig(model=ModelConfig(max_model_len=64))  # room again: the duplicate id is refused
    invalid = scheduler.add_request(EngineRequest(request_id="a", prompt_token_ids=[5], sampling=SamplingParams()))
    assert invalid.kind == "invalid" and "already in use" in invalid.message


@async_test
async def test_scheduler_overload_is_429_with_retry_after_and_its_message(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        h.engine.reject_with = Rejection(OVERLOADED, "overloaded")
        for path, body in (
            ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}),
        ):
            status, error, headers = await h.post(path, body)
            assert_error(status, error, 429, "RateLimitError")
            assert error["error"]["message"] == OVERLOADED and headers["Retry-After"] == "1"
        with pytest.raises(openai.RateLimitError) as info:
            await h.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert info.value.body["message"] == OVERLOADED
        h.engine.reject_with = "The prompt is empty."  # any other refusal stays a 400, its words verbatim
        status, error, _ = await h.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert_error(status, error, 400, "BadRequestError")
        assert error["error"]["message"] == "The prompt is empty."
        h.engine.reject_with = None
        await h.good_completion()
