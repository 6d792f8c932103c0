"""The worker's side of overlap scheduling: a plan made before the scheduler saw the last step's tokens asks the worker
to append the token it sampled itself (`RunningRequestData.append_last_sampled`); the step then computes what it
would have computed had the scheduler sent that token."""

from __future__ import annotations

import pytest

from tests.helpers.runner_driver import make_runner
from tokenmill.messages import NewRequestData, RunningRequestData, SamplingParams, StepPlan

PROMPTS = {"a": [5, 17, 99, 3, 250, 8, 41], "b": [300, 12, 7]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=8)


def first_plan() -> StepPlan:
    """Both prompts whole, on blocks 0-3 ("a") and 4-7 ("b"): each samples its first token."""
    new = [
        NewRequestData(request_id, prompt, len(prompt), GREEDY if request_id == "a" else SEEDED, blocks, 0, len(prompt))
        for (request_id, prompt), blocks in zip(PROMPTS.items(), ([0, 1, 2, 3], [4, 5, 6, 7]))
    ]
    return StepPlan(0, new, [], [])


def decode(step_id: int, sent: dict[str, list[int]], computed: dict[str, int], overlap: bool) -> StepPlan:
    """One decode token per request: its token sent (`sent`), or, with `overlap`, appended by the worker."""
    running = [
        RunningRequestData(
            request_id, [] if overlap else sent[request_id], [], computed[request_id], 1, append_last_sampled=overlap
        )
        for request_id in PROMPTS
    ]
    return StepPlan(step_id, [], running, [])


def generate(runner, overlap: bool, num_steps: int = 5) -> dict[str, list[int]]:
    result = runner.execute(first_plan())
    outputs = {request_id: [token] for request_id, token in zip(result.request_ids, result.sampled_token_ids)}
    for step_id in range(1, num_steps):
        computed = {request_id: len(PROMPTS[request_id]) + step_id - 1 for request_id in PROMPTS}
        last = {request_id: tokens[-1:] for request_id, tokens in outputs.items()}
        result = runner.execute(decode(step_id, last, computed, overlap))
        for request_id, token in zip(result.request_ids, result.sampled_token_ids):
            outputs[request_id].append(token)
    return outputs


def test_the_worker_appends_its_own_last_sampled_token(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    sent = generate(make_runner(path, num_blocks=8), overlap=False)
    appended = generate(make_runner(path, num_blocks=8), overlap=True)
    assert appended == sent
    assert all(len(tokens) == 5 for tokens in sent.values()) and len(set(sent["b"])) > 1


def test_appending_a_token_the_last_step_did_not_sample_is_an_error(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    runner = make_runner(path, num_blocks=8)
    runner.execute(first_plan())
    runner.execute(StepPlan(1, [], [], []))  # a step that samples nothing
    with pytest.raises(ValueError, match="none was sampled"):
        runner.execute(decode(2, {}, {"a": 7, "b": 3}, overlap=True))
