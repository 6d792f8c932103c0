"""The per-step message hops of a batch-1 decode step, measured between two real processes over `ipc://` ZeroMQ
sockets of the engine's kinds, with the engine's msgspec codecs (median round trips, robust to a loaded machine).

- plan → worker → result: the scheduler's PUB sends an encoded one-request `StepPlan`, the worker process's SUB
  receives and decodes it, encodes a one-token `StepResult` and PUSHes it back; the scheduler receives it through a
  `zmq.Poller` (as `SchedulerLoop.wait_for_result`) and decodes it.
- outputs → frontend: a one-token `StepOutputs` PUSHed, received and decoded, a one-byte acknowledgement back: the
  round trip is an upper bound of the one-way hop.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time

import zmq

from tokenmill.messages import (
    RequestOutput,
    RunningRequestData,
    SchedulerStats,
    Shutdown,
    StepOutputs,
    StepPlan,
    StepResult,
    WorkerCommand,
    decoder,
    encode,
)


def _echo_worker(plans_address: str, results_address: str, outputs_address: str, count: int) -> None:
    """The far side: answer each plan with a result, and acknowledge each StepOutputs."""
    ctx = zmq.Context()
    plans = ctx.socket(zmq.SUB)
    plans.connect(plans_address)
    plans.setsockopt(zmq.SUBSCRIBE, b"")
    results = ctx.socket(zmq.PUSH)
    results.connect(results_address)
    outputs = ctx.socket(zmq.PAIR)
    outputs.connect(outputs_address)
    commands, outputs_decoder = decoder(WorkerCommand), decoder(StepOutputs)
    results.send(b"ready")
    while True:
        plan = commands.decode(plans.recv())
        if not isinstance(plan, StepPlan):
            break
        results.send(encode(StepResult(plan.step_id, ["req-0"], [1234], model_time_s=0.004)))
    for _ in range(count):
        outputs_decoder.decode(outputs.recv())
        outputs.send(b"k")
    ctx.destroy(linger=0)


def message_round_trips_ms(count: int = 2000) -> dict[str, float]:
    """{"plan_result": median ms of plan → worker → result, "outputs": median ms of outputs → frontend and back}."""
    directory = tempfile.mkdtemp(prefix="tokenmill-hops-")
    plans_address, results_address, outputs_address = (
        f"ipc://{os.path.join(directory, name)}" for name in ("plans", "results", "outputs")
    )
    ctx = zmq.Context()
    plans, results, outputs = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL), ctx.socket(zmq.PAIR)
    plans.bind(plans_address)
    results.bind(results_address)
    outputs.bind(outputs_address)
    child = multiprocessing.get_context("fork").Process(
        target=_echo_worker, args=(plans_address, results_address, outputs_address, count)
    )
    child.start()
    try:
        results.recv()  # the child is up; a plan sent now may still precede its subscription: retry the first
        while not results.poll(50):
            plans.send(encode(StepPlan(-1, [], [], [])))
        time.sleep(0.1)
        while results.poll(0):  # every answer to the retried first plans
            results.recv()
        result_decoder = decoder(StepResult)
        plan_times = []
        for step in range(count):
            started = time.perf_counter()
            plans.send(encode(StepPlan(step, [], [RunningRequestData("req-0", [1234], [], 200 + step, 1)], [])))
            poller = zmq.Poller()  # as the scheduler's wait_for_result does each step
            poller.register(results, zmq.POLLIN)
            poller.poll()
            result_decoder.decode(results.recv())
            plan_times.append(time.perf_counter() - started)
        plans.send(encode(Shutdown()))  # the child moves on to the outputs
        step_outputs = StepOutputs([RequestOutput("req-0", [1234], None)], SchedulerStats(1, 0, 0.01, 0, 0, 0))
        output_times = []
        for _ in range(count):
            started = time.perf_counter()
            outputs.send(encode(step_outputs))
            outputs.recv()
            output_times.append(time.perf_counter() - started)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
        ctx.destroy(linger=0)
    return {
        "plan_result": statistics.median(plan_times) * 1e3,
        "outputs": statistics.median(output_times) * 1e3,
    }
