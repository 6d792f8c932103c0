"""Data-parallel replicas' environments: each replica sees its own GPUs and its share of the CPU threads."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from tokenmill import data_parallel
from tokenmill.config import EngineConfig, ParallelConfig
from tokenmill.data_parallel import EngineSockets, replica_environments
from tokenmill.messages import Pong, encode
from tokenmill.processes import make_socket


def config(**parallel) -> EngineConfig:
    return EngineConfig(parallel=ParallelConfig(**parallel))


def test_one_replica_inherits_the_environment():
    assert replica_environments(config(), {"CUDA_VISIBLE_DEVICES": "3"}) == [None]


def test_replicas_get_consecutive_gpu_slices_of_what_is_visible():
    envs = replica_environments(
        config(data_parallel_size=2, tensor_parallel_size=2),
        {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "OMP_NUM_THREADS": "3"},
    )
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["4,5", "6,7"]
    assert [env["OMP_NUM_THREADS"] for env in envs] == ["3", "3"]  # the user's choice stands
    envs = replica_environments(config(data_parallel_size=3), {})
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0", "1", "2"]
    assert all(int(env["OMP_NUM_THREADS"]) >= 1 for env in envs)


def test_hidden_gpus_stay_hidden_and_too_few_gpus_is_an_error():
    envs = replica_environments(config(data_parallel_size=2), {"CUDA_VISIBLE_DEVICES": ""})
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["", ""]
    with pytest.raises(ValueError, match="data_parallel_size 2"):
        replica_environments(
            config(data_parallel_size=2, tensor_parallel_size=2, device="cuda"), {"CUDA_VISIBLE_DEVICES": "0,1,2"}
        )


def test_a_size_below_one_is_refused():
    from tokenmill.data_parallel import DataParallelEngines

    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        DataParallelEngines(config(data_parallel_size=0))


def test_the_offline_client_drops_an_undecodable_frame_and_reads_on(tmp_path, caplog, monkeypatch):
    """A garbage frame on a replica's output socket is logged and dropped (as the scheduler drops one), and the
    messages after it still arrive."""
    # a library's logging.config.dictConfig earlier in the run may have disabled the loggers that existed then
    monkeypatch.setattr(data_parallel.log, "disabled", False)
    caplog.set_level(logging.ERROR, logger=data_parallel.log.name)
    configs = []
    for replica in range(2):
        ipc_dir = tmp_path / str(replica)
        ipc_dir.mkdir()
        configs.append(EngineConfig(ipc_dir=str(ipc_dir)))
    ctx = zmq.Context()
    schedulers = [make_socket(ctx, zmq.PUSH, c.ipc_address("outputs"), bind=True) for c in configs]
    sockets = EngineSockets(ctx, configs)
    try:
        schedulers[0].send(b"\xc1 not msgpack")
        schedulers[1].send(encode(Pong(7)))
        received = []
        deadline = time.monotonic() + 10
        # until both frames were read: the replicas' sockets are polled together, so the good frame may come first
        while not (received and "undecodable" in caplog.text) and time.monotonic() < deadline:
            message = sockets.receive(100)
            if message is not None:
                received.append(message)
        assert received == [Pong(7)]
        assert "dropped an undecodable 13-byte frame from replica 0's scheduler" in caplog.text
    finally:
        ctx.destroy(linger=0)
