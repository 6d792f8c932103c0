"""Output assembly shared by the server and the offline LLM: finish and stop reasons decided in one place."""

from __future__ import annotations

import pytest

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.outputs import CompletionOutput, choice_sampling_params, next_delta
from tokenmill.messages import RequestOutput, SamplingParams


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


def test_choices_get_one_request_each_with_seed_plus_index():
    params = SamplingParams(n=3, seed=10)
    assert [choice_sampling_params(params, i).seed for i in range(3)] == [10, 11, 12]
    assert all(choice_sampling_params(params, i).n == 1 for i in range(3))
    assert choice_sampling_params(SamplingParams(n=2), 1).seed is None
