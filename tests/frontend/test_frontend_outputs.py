"""Output assembly shared by the server and the offline LLM: finish and stop reasons decided in one place."""

from __future__ import annotations

import pytest

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.outputs import CompletionOutput, next_delta
from tokenmill.messages import EngineRequest, RequestOutput, SamplingParams, choice_requests


def fold(tokenizer, steps: list[RequestOutput], params: SamplingParams) -> CompletionOutput:
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    completion = CompletionOutput(0)
    for out in steps:
        completion.add(next_delta(0, detokenizer, out))
        if completion.finished:
            break
    return completion


@pytest.fixture(scope="module")
def ids(tokenizer):
    return tokenizer.encode("Paris is the capital of France.", add_special_tokens=False)


def test_a_stop_string_ends_the_choice_with_the_string_as_stop_reason(tokenizer, ids):
    steps = [RequestOutput("r", [token]) for token in ids] + [RequestOutput("r", [ids[0]], "length")]
    completion = fold(tokenizer, steps, SamplingParams(stop=["capital"]))
    assert completion.text == "Paris is the "
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "capital")
    assert completion.token_ids == ids[: len(completion.token_ids)] and len(completion.token_ids) < len(ids)


@pytest.mark.parametrize("stop_reason", [None, 42])
def test_the_engine_stop_reason_passes_through_and_the_stop_token_is_not_rendered(tokenizer, ids, stop_reason):
    eos = tokenizer.eos_token_id
    steps = [RequestOutput("r", ids[:3]), RequestOutput("r", [eos], "stop", stop_token_id=eos, stop_reason=stop_reason)]
    completion = fold(tokenizer, steps, SamplingParams())
    assert completion.text == tokenizer.decode(ids[:3])
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_reason)
    assert completion.token_ids == ids[:3] + [eos]


def test_logprobs_stay_none_unless_the_engine_sends_them(tokenizer, ids):
    assert fold(tokenizer, [RequestOutput("r", ids[:2], "length")], SamplingParams()).logprobs is None
    entry = (-0.1, [ids[0]], [-0.1])
    steps = [RequestOutput("r", ids[:1], logprobs=[entry]), RequestOutput("r", ids[1:2], "length", logprobs=[entry])]
    assert fold(tokenizer, steps, SamplingParams()).logprobs == [entry, entry]


def test_one_request_fans_out_into_its_choices_with_seed_plus_index():
    prompt = [5, 6, 7]
    group = EngineRequest(request_id="r", prompt_token_ids=prompt, sampling=SamplingParams(n=3, seed=10))
    choices = choice_requests(group)
    assert [c.request_id for c in choices] == ["r-0", "r-1", "r-2"]
    assert [c.sampling.seed for c in choices] == [10, 11, 12] and all(c.sampling.n == 1 for c in choices)
    assert all(c.prompt_token_ids is prompt for c in choices)  # one prompt, never copied
    unseeded = choice_requests(EngineRequest(request_id="u", prompt_token_ids=prompt, sampling=SamplingParams(n=2)))
    assert unseeded[0].sampling is unseeded[1].sampling and unseeded[1].sampling.seed is None
    single = EngineRequest(request_id="s", prompt_token_ids=prompt, sampling=SamplingParams())
    assert choice_requests(single) == [single]
