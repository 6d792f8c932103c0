"""The scheduler process: a loop that admits requests, plans a step, sends it to the workers and publishes outputs.

Overlap scheduling (`--async-scheduling`; on by default, except under tensor or pipeline parallelism): the loop plans
and sends step N+1, then waits for step N's result, so the workers start N+1 as soon as they finish N and the
scheduler's Python (planning, applying results, publishing outputs) runs while they compute. At most one step is in
flight while the next is planned; a step that cannot be planned ahead (`Scheduler.can_plan_ahead`) is planned once
the result is in, as without overlap. A blocking `zmq.Poller` keeps the per-step overhead to a few syscalls. Aborts
and new requests that arrive while the loop waits for a result are buffered and applied before the next step is
planned; pings are answered at once.

A watchdog bounds the wait for a step's result (`--worker-step-timeout`): a worker that does not answer in time is
treated as dead. The scheduler logs why and exits non-zero, which the launcher's supervision turns into /health 503,
an error for every request in flight (503 over HTTP) and an orderly stop of the instance. A frame that does not
decode, from either side, is logged and dropped.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.gc_heap import freeze_startup_heap
from tokenmill.messages import (
    AbortRequest,
    EngineReady,
    EngineRequest,
    FrontendMessage,
    Ping,
    Pong,
    RequestOutput,
    Shutdown,
    StepOutputs,
    StepPlan,
    StepResult,
    WatchSteps,
    WorkerError,
    WorkerMessage,
    WorkerReady,
    choice_requests,
    decoder,
    encode,
)
from tokenmill.processes import (
    become_child_process,
    decode_or_drop,
    make_socket,
    worker_socket,
    worker_socket_address,
)
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.scheduler.spec_decode import SpecDecodeLogger
from tokenmill.scheduler.step_summary import StepSummarizer
from tokenmill.scheduler.structured_outputs import GrammarCompiler, grammar_tokenizer
from tokenmill.socket_security import allow_only_workers
from tokenmill.stack_dumps import ask_for_stacks

IDLE_POLL_MS = 1000
STATS_INTERVAL_S = 0.5
# The first steps may compile kernels (Triton on first use of a shape, the CPU ops library): they get a longer watchdog.
WARMUP_STEPS = 16
WARMUP_TIMEOUT_FACTOR = 5


class WorkerFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class InFlightStep:
    """A plan sent to the workers whose result the loop has not applied yet."""

    plan: StepPlan
    planned_at: float  # time.perf_counter() when its planning began


class SchedulerLoop:
    def __init__(self, config: EngineConfig, log: logging.Logger) -> None:
        self.config = config
        self.log = log
        self.ctx = zmq.Context()
        self.from_frontend = make_socket(self.ctx, zmq.PULL, config.ipc_address("requests"), bind=True)
        self.to_frontend = make_socket(self.ctx, zmq.PUSH, config.ipc_address("outputs"), bind=True)
        # tcp:// worker sockets (Ray) admit only the instance's workers: the ZAP handler starts before they bind
        keys = config.parallel.worker_socket_keys
        self.authenticator = allow_only_workers(self.ctx, keys) if keys is not None else None
        self.to_workers = worker_socket(self.ctx, config, "plans", zmq.PUB, bind=True)
        self.from_workers = worker_socket(self.ctx, config, "results", zmq.PULL, bind=True)
        self.frontend_decoder = decoder(FrontendMessage)
        self.worker_decoder = decoder(WorkerMessage)
        self.pending: list[FrontendMessage] = []  # arrived while a step was running
        self.scheduler: Scheduler | None = None
        self.last_stats_time = 0.0
        self.steps_since_report = 0
        self.step_time_since_report = 0.0
        self.model_time_since_report = 0.0
        self.num_steps = 0
        self.in_flight: InFlightStep | None = None
        self.last_step_end = 0.0  # time.perf_counter() when the last step's result was applied
        self.local_worker_pids: list[tuple[str, int]] = []  # (name, pid): asked for their stacks when one hangs
        # the dashboard's feed: every step recorded, a StepSummary sent while a WatchSteps asks for them
        self.spec_log = SpecDecodeLogger(log) if config.speculative.method is not None else None
        self.summaries = StepSummarizer(
            lambda summary: self.to_frontend.send(encode(summary)), engine_index=config.parallel.data_parallel_rank
        )

    # ------------------------------------------------------------------ start-up

    def wait_for_workers(self) -> list[WorkerReady]:
        readies: dict[int, WorkerReady] = {}
        while len(readies) < self.config.parallel.world_size:
            msg = decode_or_drop(self.worker_decoder, self.from_workers.recv(), self.log, "a worker")
            if isinstance(msg, WorkerError):
                raise WorkerFailed(f"worker {msg.rank} failed to start: {msg.message}")
            if isinstance(msg, WorkerReady):
                readies[msg.rank] = msg
        return [readies[r] for r in sorted(readies)]

    def start(self) -> None:
        readies = self.wait_for_workers()
        self.local_worker_pids = local_worker_pids(self.config, readies)
        num_blocks = min(r.num_kv_blocks for r in readies)
        first = readies[0]
        grammars = None
        if first.vocab_size:  # a language model: structured outputs can constrain it
            grammars = GrammarCompiler(
                lambda: grammar_tokenizer(self.config.model, first.vocab_size, first.eos_token_ids),
                cache_bytes=self.config.scheduler.structured_outputs_cache_bytes,
            )
            grammars.wait_for_tokenizer()  # before EngineReady: its load would stall the loop's first steps
        self.scheduler = Scheduler(
            self.config,
            num_blocks,
            first.eos_token_ids,
            grammars=grammars,
            sliding_window=first.sliding_window,
            prompt_logprobs_row_cost=max(r.prompt_logprobs_row_cost for r in readies),
            replayed_step=(
                min(r.replayed_step_seqs for r in readies),
                min(r.replayed_step_tokens for r in readies),
            ),
        )
        self.to_frontend.send(
            encode(
                EngineReady(
                    num_kv_blocks=num_blocks,
                    block_size=self.config.cache.block_size,
                    max_model_len=self.config.model.max_model_len,
                    weight_bytes=sum(r.weight_bytes for r in readies),
                    device=first.device,
                    dtype=first.dtype,
                    architecture=first.architecture,
                )
            )
        )

    # ------------------------------------------------------------------ messages from the frontend

    def handle(self, msg: FrontendMessage) -> None:
        assert self.scheduler is not None
        if isinstance(msg, EngineRequest):
            rejection = self.scheduler.add_request(msg)
            if rejection is not None:  # every choice learns why
                self.publish(
                    [
                        RequestOutput(
                            choice.request_id,
                            [],
                            finish_reason="error",
                            error=rejection.message,
                            error_kind=rejection.kind,
                        )
                        for choice in choice_requests(msg)
                    ]
                )
        elif isinstance(msg, AbortRequest):
            self.publish(self.scheduler.abort_requests(msg.request_ids))
        elif isinstance(msg, Ping):
            self.to_frontend.send(encode(Pong(msg.nonce)))
        elif isinstance(msg, WatchSteps):
            self.summaries.watch(msg.interval_s)

    def drain_frontend(self, timeout_ms: int) -> None:
        """Handle buffered messages, then everything queued on the socket (waiting up to timeout_ms for the first)."""
        for msg in self.pending:
            self.handle(msg)
        self.pending.clear()
        if timeout_ms and not self.from_frontend.poll(timeout_ms):
            return
        while True:
            try:
                raw = self.from_frontend.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = decode_or_drop(self.frontend_decoder, raw, self.log, "the frontend")
            if message is not None:
                self.handle(message)

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Send this step's outputs, with stats when a request finished or STATS_INTERVAL_S has passed."""
        now = time.monotonic()
        stats = None
        if now - self.last_stats_time >= STATS_INTERVAL_S or any(o.finish_reason for o in outputs):
            assert self.scheduler is not None, "outputs are published only once the scheduler runs"
            stats = msgspec.structs.replace(
                self.scheduler.stats(),
                num_steps=self.steps_since_report,
                step_time_s=self.step_time_since_report,
                model_time_s=self.model_time_since_report,
            )
            self.steps_since_report, self.step_time_since_report, self.model_time_since_report = 0, 0.0, 0.0
            if self.spec_log is not None:
                self.spec_log.observe(stats)
            self.last_stats_time = now
        if outputs or stats is not None:
            self.to_frontend.send(encode(StepOutputs(outputs, stats)))

    # ------------------------------------------------------------------ the step

    def step_timeout_s(self) -> float | None:
        timeout = self.config.scheduler.worker_step_timeout_s
        if timeout <= 0:
            return None
        return timeout * WARMUP_TIMEOUT_FACTOR if self.num_steps < WARMUP_STEPS else timeout

    def wait_for_result(self, step_id: int) -> StepResult:
        poller = zmq.Poller()
        poller.register(self.from_workers, zmq.POLLIN)
        poller.register(self.from_frontend, zmq.POLLIN)
        timeout = self.step_timeout_s()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = None
            if deadline is not None:
                wait_ms = math.ceil((deadline - time.monotonic()) * 1000)
                if wait_ms <= 0:
                    ask_for_stacks(self.local_worker_pids, self.log)  # where was it? before the launcher kills it
                    raise WorkerFailed(
                        f"no worker answered step {step_id} within {timeout:g} s "
                        f"(--worker-step-timeout); treating the worker as dead"
                    )
            for sock, _ in poller.poll(wait_ms):
                if sock is self.from_workers:
                    msg = decode_or_drop(self.worker_decoder, sock.recv(), self.log, "a worker")
                    if isinstance(msg, WorkerError):
                        raise WorkerFailed(f"worker {msg.rank} failed: {msg.message}")
                    if isinstance(msg, StepResult) and msg.step_id == step_id:
                        return msg
                else:
                    msg = decode_or_drop(self.frontend_decoder, sock.recv(), self.log, "the frontend")
                    if isinstance(msg, Ping):
                        self.to_frontend.send(encode(Pong(msg.nonce)))
                    elif msg is not None:
                        self.pending.append(msg)

    def run(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        """One turn of the loop: plan the next step (ahead of the one in flight when it can), then apply the result
        of the one in flight."""
        sched = self.scheduler
        assert sched is not None
        busy = sched.has_unfinished_requests() or self.in_flight is not None
        self.drain_frontend(0 if busy else IDLE_POLL_MS)
        planned_at = time.perf_counter()
        plan = sched.schedule() if self.in_flight is None or sched.can_plan_ahead() else None
        if plan is not None:
            self.to_workers.send(encode(plan))
        if self.in_flight is not None:
            self.finish_step(self.in_flight)
        elif plan is None:
            self.publish(sched.take_pending_outputs())  # also keeps stats flowing while idle
            self.summaries.maybe_publish(sched)
            if sched.has_unfinished_requests():
                self.drain_frontend(10)
        self.in_flight = InFlightStep(plan, planned_at) if plan is not None else None

    def finish_step(self, step: InFlightStep) -> None:
        """Wait for the step's result, apply it, publish the outputs and count its time: from its planning, or from
        the previous step's end when it was planned during that step (overlap)."""
        sched = self.scheduler
        assert sched is not None
        result = self.wait_for_result(step.plan.step_id)
        self.num_steps += 1
        self.publish(sched.update(step.plan, result))
        started = max(step.planned_at, self.last_step_end)
        self.summaries.record(step.plan, time.perf_counter() - started, sched.counter_totals()[2])
        self.summaries.maybe_publish(sched)
        # counted after publishing, so the overhead figure includes encoding and sending the outputs and summaries
        self.last_step_end = time.perf_counter()
        self.steps_since_report += 1
        self.step_time_since_report += self.last_step_end - started
        self.model_time_since_report += result.model_time_s

    def close(self) -> None:
        try:
            self.to_workers.send(encode(Shutdown()))
        finally:
            if self.authenticator is not None:
                self.authenticator.stop()
            self.ctx.destroy(linger=0)


def local_worker_pids(config: EngineConfig, readies: list[WorkerReady]) -> list[tuple[str, int]]:
    """(name, pid) of the workers on this host (ipc:// sockets); none under Ray, whose pids are other hosts'."""
    if not worker_socket_address(config, "results").startswith("ipc://"):
        return []
    return [(f"worker{ready.rank}", ready.pid) for ready in readies if ready.pid > 0]


def run_scheduler_process(config_bytes: bytes) -> None:
    """Entry point of the scheduler process (started by the launcher)."""
    log = become_child_process("scheduler")
    config = EngineConfig.from_bytes(config_bytes)
    loop = SchedulerLoop(config, log)
    try:
        loop.start()
        freeze_startup_heap()
        loop.run()
    except WorkerFailed as exc:
        log.error("%s", exc)
        raise SystemExit(1) from None
    finally:
        loop.close()
