"""A worker that stops answering is asked for its Python stacks before the scheduler gives up on it: the scheduler
loop, over its real sockets, against a worker process (tests/helpers/hanging_worker.py) that hangs in its first step.
The worker's log must then say where it was."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import zmq

from tests.helpers.sched_testing import make_request
from tokenmill.config import EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.messages import encode
from tokenmill.processes import make_socket
from tokenmill.scheduler.process import SchedulerLoop, WorkerFailed

log = logging.getLogger("test_hung_worker_stacks")


def test_a_hung_worker_is_asked_for_its_stacks_before_it_is_declared_dead(tmp_path, caplog):
    config = EngineConfig(
        model=ModelConfig(max_model_len=64),
        scheduler=SchedulerConfig(max_num_seqs=4, worker_step_timeout_s=0.4),  # x5 in the first steps: 2 s
        ipc_dir=str(tmp_path),
    )
    loop = SchedulerLoop(config, log)
    ctx = zmq.Context()
    worker_log = tmp_path / "worker.log"
    with open(worker_log, "wb") as stderr:
        worker = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.hanging_worker"], stdin=subprocess.PIPE, stderr=stderr
        )
    try:
        assert worker.stdin is not None
        worker.stdin.write(config.for_workers().to_bytes())
        worker.stdin.close()
        to_scheduler = make_socket(ctx, zmq.PUSH, config.ipc_address("requests"), bind=False)
        outputs = make_socket(ctx, zmq.PULL, config.ipc_address("outputs"), bind=False)  # a PUSH blocks without one
        to_scheduler.send(encode(make_request("r0", 5, max_tokens=4)))
        loop.start()
        assert loop.local_worker_pids == [("worker0", worker.pid)] and outputs.poll(5000)  # EngineReady
        deadline = time.monotonic() + 30
        with caplog.at_level(logging.ERROR, logger=log.name), pytest.raises(WorkerFailed, match="worker-step-timeout"):
            while time.monotonic() < deadline:
                loop.run_once()
        assert worker.poll() is None, "the worker is asked, not killed: the launcher stops it"
        assert f"asked worker0 (pid {worker.pid}, state S (sleeping)" in caplog.text  # its state before the signal
        dump = worker_log.read_text()
        assert "Current thread" in dump, dump
        assert "tests/helpers/hanging_worker.py" in dump and "in hang_inside_a_step" in dump, dump
    finally:
        worker.kill()
        worker.wait(10)
        ctx.destroy(linger=0)
        loop.close()
