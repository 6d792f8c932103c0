"""Speculative-decoding runs through a model runner: a prompt that repeats, and greedy generation with drafts."""

from __future__ import annotations

from tokenmill.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.messages import EngineRequest, SamplingParams, StepPlan, WorkerCommand, decoder, encode
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.workers.worker import Worker

RUNNER_BLOCKS = 64
CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    if width < 0 or height < 0:
        raise ValueError("negative size")
    return width * height
'''
_plans = decoder(WorkerCommand)


def generate(
    runner: Worker,
    speculative: SpeculativeConfig,
    requests: list[tuple[int, EngineRequest]],
    *,
    num_blocks: int,
    budget: int,
    tag: str,
    lora: LoRAConfig | None = None,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Run the requests (each added at its step) to completion; request ids get `tag` so runs never share state."""
    config = EngineConfig(
        cache=CacheConfig(block_size=16, enable_prefix_caching=True),
        # chunks set by the budget alone, not by a prefill limit learnt from this machine's step times
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, long_prefill_token_threshold=budget),
        speculative=speculative,
        lora=lora or LoRAConfig(),  # the scheduler admits adapter requests only where the worker serves them
    )
    scheduler = Scheduler(config, num_blocks, runner.eos_token_ids)
    outputs: dict[str, list[int]] = {}
    for step in range(1000):
        for arrival, request in requests:
            if arrival == step:
                assert (
                    scheduler.add_request(
                        EngineRequest(
                            request_id=f"{tag}-{request.request_id}",
                            prompt_token_ids=request.prompt_token_ids,
                            sampling=request.sampling,
                            lora_request=request.lora_request,
                        )
                    )
                    is None
                )
        if step > max(arrival for arrival, _ in requests) and not scheduler.has_unfinished_requests():
            return outputs, scheduler
        plan = scheduler.schedule()
        if plan is None:
            continue
        wire_plan = _plans.decode(encode(plan))
        assert isinstance(wire_plan, StepPlan)
        for out in scheduler.update(plan, runner.execute(wire_plan)):
            outputs.setdefault(out.request_id.removeprefix(f"{tag}-"), []).extend(out.new_token_ids)
    raise AssertionError("not finished")


def requests(max_tokens: int, seeded: bool) -> list[tuple[int, EngineRequest]]:
    """Two greedy requests, and a third (seeded, or greedy) with the first one's prompt."""
    prompt = [(i * 7) % 50 + 100 for i in range(40)]
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    third = SamplingParams(max_tokens=max_tokens, temperature=0.8 if seeded else 0.0, seed=3, ignore_eos=True)
    return [
        (0, EngineRequest(request_id="a", prompt_token_ids=prompt, sampling=greedy)),
        (0, EngineRequest(request_id="b", prompt_token_ids=prompt[5:] + prompt[:5], sampling=greedy)),
        # arrives once the first prompt is cached: prefix hits (the draft's KV lives in the same blocks)
        (3, EngineRequest(request_id="c", prompt_token_ids=prompt, sampling=third)),
    ]
