"""The scheduler's CPU time per step at a large decode batch, in this process: no workers, no sockets.

N requests of --prompt-len tokens are prefilled, then decoded with overlap scheduling as the scheduler process runs
them (`scheduler/process.py`: step N+1 planned before step N's result is applied). A fake worker (the tests' one,
untimed) answers every plan. Per decode step it times `schedule()`, `update()` and the msgspec encoding of the plan
and decoding of the result (what the scheduler's side of the sockets costs), and prints the medians: the scheduler's
share of issue 27's "CPU time per step at batch 256 excluding the forward".

    python scripts/bench_scheduler_step.py --batch 256 --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.sched_testing import FakeWorker, make_config, make_request  # noqa: E402
from tokenmill.messages import WorkerMessage, decoder, encode  # noqa: E402
from tokenmill.scheduler.scheduler import Scheduler  # noqa: E402


def run(batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Median milliseconds per decode step of each part, over `steps` steps after the prefills."""
    config = make_config(
        block_size=16, max_num_batched_tokens=2048, max_num_seqs=batch, max_model_len=prompt_len + steps + 64
    )
    num_blocks = batch * ((prompt_len + steps + 64) // 16 + 2)
    scheduler = Scheduler(config, num_kv_blocks=num_blocks, eos_token_ids=[2])
    for i in range(batch):
        assert scheduler.add_request(make_request(f"r{i}", prompt_len, max_tokens=steps + 32, ignore_eos=True)) is None
    worker = FakeWorker(16)
    result_decoder = decoder(WorkerMessage)
    times: dict[str, list[float]] = {"schedule": [], "update": [], "encode_plan": [], "decode_result": []}
    in_flight = None
    for _ in range(steps + prompt_len * batch // 2048 + 4):
        started = time.perf_counter()
        plan = scheduler.schedule() if in_flight is None or scheduler.can_plan_ahead() else None
        scheduled_at = time.perf_counter()
        if plan is not None:
            encode(plan)  # timed only: the fake worker takes the plan object
        encoded_at = time.perf_counter()
        executed = (plan, encode(worker.execute(plan))) if plan is not None else None
        decoding = len(plan.new_requests) == 0 if plan is not None else False
        if in_flight is not None:
            decode_started = time.perf_counter()
            result = result_decoder.decode(in_flight[1])
            decoded_at = time.perf_counter()
            scheduler.update(in_flight[0], result)
            updated_at = time.perf_counter()
            if decoding and len(in_flight[0].running) == batch:
                times["schedule"].append(scheduled_at - started)
                times["encode_plan"].append(encoded_at - scheduled_at)
                times["decode_result"].append(decoded_at - decode_started)
                times["update"].append(updated_at - decoded_at)
        in_flight = executed
    return {part: 1e3 * statistics.median(values) for part, values in times.items() if values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    medians = run(args.batch, args.prompt_len, args.steps)
    for part, ms in medians.items():
        print(f"{part:14s} {ms:7.3f} ms")
    print(f"{'total':14s} {sum(medians.values()):7.3f} ms per decode step at batch {args.batch}")


if __name__ == "__main__":
    main()
