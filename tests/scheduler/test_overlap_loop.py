"""The scheduler process's loop under overlap scheduling, over its real sockets: plan N+1 goes out before the result
of step N comes back, and the outputs are those of the synchronous loop. A fake worker (tests/helpers/sched_testing.py)
answers each plan only once the next one arrived (or after HOLD_S), so a loop that waits for each result first is
seen waiting. The test turns the loop (`run_once`) until every request finished and no step is in flight."""

from __future__ import annotations

import logging
import threading
import time

import zmq

from tests.helpers.sched_testing import EOS, FakeWorker, WorkerRequestState, make_request
from tokenmill.config import EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.messages import (
    SchedulerMessage,
    StepOutputs,
    WorkerCommand,
    WorkerReady,
    decoder,
    encode,
)
from tokenmill.processes import make_socket, worker_socket
from tokenmill.scheduler.process import SchedulerLoop

log = logging.getLogger("test_overlap_loop")
HOLD_S = 0.5  # how long the fake worker holds a result back waiting for the next plan
IDLE_S = 3.0  # no plan for this long after its last result: the fake worker stops


def sample(request_id: str, state: WorkerRequestState) -> int:
    return 100 + len(state.token_ids)


def serve_plans(config: EngineConfig, events: list[str]) -> None:
    """A worker on the loop's sockets: reports ready, runs each plan at once but sends its result only when the next
    plan arrives (or HOLD_S passed); stops once no plan comes."""
    ctx = zmq.Context()
    try:
        plans = worker_socket(ctx, config, "plans", zmq.SUB, bind=False)
        results = worker_socket(ctx, config, "results", zmq.PUSH, bind=False)
        time.sleep(0.3)  # PUB/SUB: the subscription reaches the loop before its first plan
        ready = WorkerReady(
            rank=0, num_kv_blocks=64, weight_bytes=0, device="cpu", dtype="float32", architecture="fake"
        )
        results.send(encode(ready))
        worker, commands, held = FakeWorker(config.cache.block_size, sample), decoder(WorkerCommand), None
        while True:
            if plans.poll((HOLD_S if held is not None else IDLE_S) * 1000):
                plan = commands.decode(plans.recv())
                events.append(f"plan {plan.step_id}")
                result, held = held, worker.execute(plan)
            else:
                result, held = held, None
                if result is None:
                    return
            if result is not None:
                events.append(f"result {result.step_id}")
                results.send(encode(result))
    except Exception as exc:  # the loop's watchdog then fails the test, which shows the events
        events.append(f"worker failed: {exc!r}")
    finally:
        ctx.destroy(linger=200)


def run_loop(tmp_path, async_scheduling: bool | None) -> tuple[list[str], dict[str, list[int]]]:
    """Two requests through a SchedulerLoop and the fake worker: (the worker's events, tokens streamed per request)."""
    tmp_path.mkdir()
    config = EngineConfig(
        model=ModelConfig(max_model_len=64),
        # a worker that stops answering fails the test in 5 x 2 s
        scheduler=SchedulerConfig(max_num_seqs=4, async_scheduling=async_scheduling, worker_step_timeout_s=2),
        ipc_dir=str(tmp_path),
    )
    loop = SchedulerLoop(config, log)
    ctx = zmq.Context()
    events: list[str] = []
    worker = threading.Thread(target=serve_plans, args=(config.for_workers(), events), daemon=True)
    try:
        to_scheduler = make_socket(ctx, zmq.PUSH, config.ipc_address("requests"), bind=False)
        from_scheduler = make_socket(ctx, zmq.PULL, config.ipc_address("outputs"), bind=False)
        for i in range(2):
            to_scheduler.send(encode(make_request(f"r{i}", 5 + i, max_tokens=6, ignore_eos=True)))
        worker.start()
        loop.start()
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()
        messages = decoder(SchedulerMessage)
        deadline = time.monotonic() + 60
        while len(finished) < 2 or loop.in_flight is not None:
            assert time.monotonic() < deadline, f"the requests did not finish: {events}"
            loop.run_once()
            while from_scheduler.poll(0):
                message = messages.decode(from_scheduler.recv())
                for out in message.outputs if isinstance(message, StepOutputs) else []:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    finished |= {out.request_id} if out.finish_reason else set()
        return events, tokens
    finally:
        worker.join(10)
        ctx.destroy(linger=0)
        loop.close()


def test_the_next_plan_goes_out_before_the_last_result_comes_back(tmp_path):
    events, tokens = run_loop(tmp_path / "overlap", async_scheduling=True)
    assert events[:3] == ["plan 0", "plan 1", "result 0"], events
    sent = {event: i for i, event in enumerate(events)}
    # six tokens: the prompt step samples the first, five decode steps the others, each planned ahead; none after
    assert [k for k in range(1, 6) if sent[f"plan {k}"] < sent[f"result {k - 1}"]] == [1, 2, 3, 4, 5], events
    assert "plan 6" not in sent, "a step planned past max_tokens"
    sync_events, sync_tokens = run_loop(tmp_path / "sync", async_scheduling=False)
    assert sync_events[:3] == ["plan 0", "result 0", "plan 1"], sync_events
    auto_events, _ = run_loop(tmp_path / "auto", async_scheduling=None)  # the default: on, CPU workers too
    assert auto_events[:3] == ["plan 0", "plan 1", "result 0"], auto_events
    assert tokens == sync_tokens and sorted(tokens) == ["r0", "r1"] and all(len(t) == 6 for t in tokens.values())
    assert EOS not in tokens["r0"]
