"""A request resumed on a fresh engine (--restart-on-failure) goes on like a request resumed after a preemption."""

from __future__ import annotations

import msgspec

from tests.helpers.sched_testing import EOS, FakeWorker, make_config, make_request, run_to_completion
from tokenmill.scheduler.scheduler import Scheduler


def make_scheduler(num_blocks: int, block_size: int) -> tuple[Scheduler, FakeWorker]:
    config = make_config(block_size=block_size)
    return Scheduler(config, num_blocks, [EOS]), FakeWorker(block_size)


def test_resumed_outputs_are_prefilled_and_counted_as_outputs():
    sched, worker = make_scheduler(num_blocks=16, block_size=4)
    request = make_request("r", [5, 6, 7, 8, 9], max_tokens=6)
    sched.add_request(msgspec.structs.replace(request, resumed_output_token_ids=[11, 12, 13, 14]))
    assert sched.requests["r"].num_output_tokens == 4

    outputs = run_to_completion(sched, worker)
    (sent,) = [new for new in worker.new_requests_seen if new.request_id == "r"]
    assert sent.token_ids == [5, 6, 7, 8, 9, 11, 12, 13, 14]  # prompt + what it had streamed, prefilled together
    assert sent.num_prompt_tokens == 5 and sent.num_computed_tokens == 0 and sent.num_scheduled_tokens == 9
    new_tokens = [token for out in outputs["r"] for token in out.new_token_ids]
    assert len(new_tokens) == 2  # max_tokens 6 counts the 4 it already had
    assert outputs["r"][-1].finish_reason == "length" and outputs["r"][-1].num_prompt_tokens == 5
    assert sched.kv.pool.num_free_blocks == 16
