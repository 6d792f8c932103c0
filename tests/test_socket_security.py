"""The scheduler's worker sockets over tcp:// (as with Ray, forced here on loopback): CURVE admits only the instance's
workers, frames are bounded, an undecodable frame is dropped, and each child's config carries only what it needs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import msgspec
import pytest
import zmq

from tokenmill import processes
from tokenmill.config import (
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    replace,
)
from tokenmill.frontend.engine_client import AsyncEngineClient
from tokenmill.messages import (
    EngineReady,
    Ping,
    Pong,
    SchedulerMessage,
    StepResult,
    decoder,
    encode,
)
from tokenmill.processes import decode_or_drop, worker_socket
from tokenmill.scheduler.process import SchedulerLoop
from tokenmill.socket_security import new_worker_socket_keys

log = logging.getLogger("test_socket_security")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tcp_config(tmp_path) -> EngineConfig:
    """An instance whose worker sockets are tcp:// on loopback, as under Ray."""
    parallel = ParallelConfig(
        worker_addresses={name: f"tcp://127.0.0.1:{free_port()}" for name in ("plans", "results")},
        worker_socket_keys=new_worker_socket_keys(),
    )
    return EngineConfig(
        model=ModelConfig(max_model_len=64),
        scheduler=SchedulerConfig(max_num_seqs=2),
        parallel=parallel,
        server=ServerConfig(api_key="s3cret"),
        ipc_dir=str(tmp_path),
    )


@pytest.fixture
def scheduler(tcp_config):
    loop = SchedulerLoop(tcp_config, log)
    yield loop
    loop.close()


def intruder(ctx: zmq.Context, kind: int, address: str, server_public: str | None) -> zmq.Socket:
    """A peer without the instance's keys: plain, or CURVE with the scheduler's public key but its own key pair."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if server_public is not None:
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(address)
    return sock


def result(step_id: int, token: int) -> bytes:
    return encode(StepResult(step_id=step_id, request_ids=["r"], sampled_token_ids=[token]))


def test_only_the_instances_workers_get_plans_and_push_results(tcp_config, scheduler):
    keys = tcp_config.parallel.worker_socket_keys
    addresses = tcp_config.parallel.worker_addresses
    ctx = zmq.Context()
    try:
        worker_config = tcp_config.for_workers()
        plans = worker_socket(ctx, worker_config, "plans", zmq.SUB, bind=False)
        results = worker_socket(ctx, worker_config, "results", zmq.PUSH, bind=False)
        spies = [intruder(ctx, zmq.SUB, addresses["plans"], public) for public in (None, keys.server_public)]
        forgers = [intruder(ctx, zmq.PUSH, addresses["results"], public) for public in (None, keys.server_public)]
        deadline = time.monotonic() + 10
        while not plans.poll(50):  # PUB/SUB: until the worker's subscription has arrived
            assert time.monotonic() < deadline, "the instance's own worker never got a plan"
            scheduler.to_workers.send(b"plan")
        time.sleep(0.3)  # time for an intruder's handshake and subscription, were they allowed
        for _ in range(5):
            scheduler.to_workers.send(b"secret plan")
        assert all(spy.poll(500) == 0 for spy in spies)
        for forger in forgers:
            with contextlib.suppress(zmq.Again):  # refused: the forger has no connection to queue it on
                forger.send(result(7, token=666), zmq.NOBLOCK)
        time.sleep(0.3)
        results.send(result(7, token=1))
        assert scheduler.wait_for_result(7).sampled_token_ids == [1]
        assert scheduler.from_workers.poll(300) == 0  # the forged results never arrived
    finally:
        ctx.destroy(linger=0)


def test_garbage_and_oversized_frames_are_dropped(tcp_config, monkeypatch, tmp_path):
    monkeypatch.setattr(processes, "max_message_bytes", lambda config: 1 << 20)
    loop = SchedulerLoop(tcp_config, log)
    ctx = zmq.Context()
    try:
        results = worker_socket(ctx, tcp_config.for_workers(), "results", zmq.PUSH, bind=False)
        to_scheduler = processes.make_socket(ctx, zmq.PUSH, tcp_config.ipc_address("requests"), bind=False)
        from_scheduler = processes.make_socket(ctx, zmq.PULL, tcp_config.ipc_address("outputs"), bind=False)
        to_scheduler.send(b"\xc1 not msgpack")
        to_scheduler.send(encode(Ping(5)))
        results.send(b"\xc1 garbage from a worker")
        results.send(result(3, token=9))
        assert loop.wait_for_result(3).sampled_token_ids == [9]
        results.send(b"\x00" * (2 << 20))  # past MAXMSGSIZE: libzmq drops the connection, which reconnects
        assert loop.from_workers.poll(1000) == 0
        results.send(result(4, token=10))
        assert loop.wait_for_result(4).sampled_token_ids == [10]
        assert from_scheduler.poll(2000)
        assert decoder(SchedulerMessage).decode(from_scheduler.recv()) == Pong(5)
    finally:
        ctx.destroy(linger=0)
        loop.close()


def test_decode_or_drop_logs_and_returns_none(caplog):
    dec = decoder(SchedulerMessage)
    assert decode_or_drop(dec, encode(Pong(1)), log, "a test") == Pong(1)
    with caplog.at_level(logging.ERROR):
        assert decode_or_drop(dec, b"\xc1", log, "a test") is None
        assert decode_or_drop(dec, msgspec.msgpack.encode(["NoSuchMessage", 1]), log, "a test") is None
    assert sum("undecodable" in r.getMessage() for r in caplog.records) == 2


def test_frontend_survives_a_garbage_output_frame(tmp_path):
    config = EngineConfig(ipc_dir=str(tmp_path))

    async def scenario() -> EngineReady:
        ctx = zmq.Context()
        outputs = processes.make_socket(ctx, zmq.PUSH, config.ipc_address("outputs"), bind=True)
        client = AsyncEngineClient(config)
        client.start()
        try:
            outputs.send(b"\xc1 garbage")
            ready = EngineReady(
                num_kv_blocks=1,
                block_size=16,
                max_model_len=16,
                weight_bytes=0,
                device="cpu",
                dtype="float32",
                architecture="x",
            )
            outputs.send(encode(ready))
            return await client.wait_ready(timeout=5)
        finally:
            client.close()
            ctx.destroy(linger=0)

    assert asyncio.run(scenario()).architecture == "x"


def test_children_get_no_api_key_and_workers_no_scheduler_secret(tcp_config):
    keys = tcp_config.parallel.worker_socket_keys
    scheduler = EngineConfig.from_bytes(tcp_config.for_scheduler().to_bytes())
    workers = EngineConfig.from_bytes(tcp_config.for_workers().to_bytes())
    assert scheduler.server.api_key is None and workers.server.api_key is None
    assert scheduler.parallel.worker_socket_keys == keys
    assert workers.parallel.worker_socket_keys == replace(keys, server_secret="")
    assert b"s3cret" not in tcp_config.for_workers().to_bytes()
    assert keys.server_secret.encode() not in tcp_config.for_workers().to_bytes()


def test_a_tcp_worker_socket_needs_keys(tcp_config):
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="worker_socket_keys"):
            worker_socket(
                ctx,
                replace(tcp_config, parallel=replace(tcp_config.parallel, worker_socket_keys=None)),
                "plans",
                zmq.SUB,
                bind=False,
            )
        with pytest.raises(ValueError, match="secret"):
            worker_socket(ctx, tcp_config.for_workers(), "plans", zmq.PUB, bind=True)
    finally:
        ctx.destroy(linger=0)
