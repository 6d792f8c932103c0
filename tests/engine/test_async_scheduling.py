"""Overlap scheduling end to end (`--async-scheduling`): the offline LLM over a tiny random-weight checkpoint gives the
same tokens with it on and off, under chunked prefill, preemption (a tiny KV pool) and prefix caching, with n > 1,
seeded sampling, stop token ids and max_tokens, and with a structured-output request in the batch (its steps fall
back to synchronous planning); every KV block is free at the end."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams, StructuredOutputsParams

SHARED = "The history of the old city begins with a small settlement by the river, where"
PROMPTS = [SHARED + f" story {i}:" for i in range(4)] + ["Hello", "One two three four five six seven eight nine"]
REGEX = "[a-z]{3,8}-[0-9]{2}"


def sampling_params() -> list[SamplingParams]:
    """Greedy with n = 2, stop ids and several max_tokens; seeded sampling; a regex-constrained request."""
    params = [
        SamplingParams(max_tokens=30 + 4 * i, temperature=0, ignore_eos=True, n=2 if i == 0 else 1)
        for i in range(len(PROMPTS))
    ]
    params[1] = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=list(range(100, 4000)))
    params[2] = SamplingParams(max_tokens=25, temperature=1.0, top_k=50, seed=7, ignore_eos=True, n=2)
    params[3] = SamplingParams(max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(regex=REGEX))
    return params


def generate(model: str, async_scheduling: bool) -> tuple[list[list[tuple[list[int], str | None]]], list[float]]:
    """Every request's choices as (tokens, finish reason), and the KV usage of every stats report."""
    # 8 blocks of 16 tokens: the batch does not fit at once (preemption); 32-token steps chunk every prompt
    with LLM(
        model,
        max_model_len=256,
        num_kv_blocks=8,
        block_size=16,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    ) as llm:
        usage: list[float] = []
        preemptions: list[int] = []

        def listen(step) -> None:
            if step.stats is not None:
                usage.append(step.stats.kv_cache_usage)
                preemptions.append(step.stats.num_preemptions)

        llm.step_listener = listen
        results = llm.generate(PROMPTS, sampling_params(), use_tqdm=False)
    assert sum(preemptions) > 0, "the batch must preempt"
    return [[(list(o.token_ids), o.finish_reason) for o in r.outputs] for r in results], usage


@pytest.mark.slow
def test_async_scheduling_gives_the_synchronous_tokens(tiny_checkpoints):
    model = str(tiny_checkpoints("llama"))
    overlapped, usage = generate(model, async_scheduling=True)
    synchronous, _ = generate(model, async_scheduling=False)
    assert overlapped == synchronous
    assert usage[-1] == 0.0, "a KV block leaked"
    finish_reasons = {reason for choices in synchronous for _, reason in choices}
    assert finish_reasons == {"length", "stop"}
    assert len(synchronous[0]) == 2 and len(synchronous[2]) == 2
    constrained = synchronous[3][0][0]
    assert constrained and len(constrained) < 20
