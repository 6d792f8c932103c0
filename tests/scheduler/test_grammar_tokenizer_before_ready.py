"""The scheduler loads the structured-output tokenizer before it says it is ready: loading it later, on a thread
beside the loop, held the GIL in stretches of up to 0.58 s (the default model's vocabulary), stalling every request
that ran meanwhile (issue 28's bystander: a 400-600 ms gap)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from tokenmill.config import EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.messages import EngineReady, SchedulerMessage, WorkerReady, decoder, encode
from tokenmill.processes import make_socket, worker_socket
from tokenmill.scheduler import process
from tokenmill.scheduler.process import SchedulerLoop

log = logging.getLogger("test_grammar_tokenizer_before_ready")


def report_ready(config: EngineConfig) -> None:
    """A worker of a language model (a vocabulary: structured outputs apply) that reports ready and nothing else."""
    ctx = zmq.Context()
    try:
        results = worker_socket(ctx, config, "results", zmq.PUSH, bind=False)
        ready = WorkerReady(
            rank=0, num_kv_blocks=64, weight_bytes=0, device="cpu", dtype="float32", architecture="fake", vocab_size=32
        )
        results.send(encode(ready))
    finally:
        ctx.destroy(linger=1000)


def test_engine_ready_waits_for_the_grammar_tokenizer(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    loaded: list[float] = []

    def slow_tokenizer(*args: object) -> object:
        release.wait(30)
        loaded.append(time.monotonic())
        return object()

    monkeypatch.setattr(process, "grammar_tokenizer", slow_tokenizer)
    config = EngineConfig(
        model=ModelConfig(max_model_len=64), scheduler=SchedulerConfig(max_num_seqs=4), ipc_dir=str(tmp_path)
    )
    loop = SchedulerLoop(config, log)
    ctx = zmq.Context()
    try:
        from_scheduler = make_socket(ctx, zmq.PULL, config.ipc_address("outputs"), bind=False)
        threading.Thread(target=report_ready, args=(config.for_workers(),), daemon=True).start()
        starting = threading.Thread(target=loop.start, daemon=True)
        starting.start()
        assert not from_scheduler.poll(1000), "EngineReady went out while the grammar tokenizer was loading"
        release.set()
        assert from_scheduler.poll(10_000)
        ready_at = time.monotonic()
        assert isinstance(decoder(SchedulerMessage).decode(from_scheduler.recv()), EngineReady)
        assert loaded and loaded[0] <= ready_at
        starting.join(10)
    finally:
        release.set()
        ctx.destroy(linger=0)
        loop.close()
