"""The torch.distributed rendezvous store listens on the rendezvous host only, not on every interface."""

from __future__ import annotations

import datetime
import socket
import threading

import psutil

from tokenmill.workers.rendezvous import rendezvous_store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_addresses(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_rank0_store_listens_on_the_host_only_and_other_ranks_join():
    port = free_port()
    timeout = datetime.timedelta(seconds=20)
    master = rendezvous_store("127.0.0.1", port, rank=0, world_size=2, timeout=timeout)
    assert listening_addresses(port) == {"127.0.0.1"}  # init_method="tcp://..." listens on 0.0.0.0 / ::
    joined: list[bytes] = []
    thread = threading.Thread(
        target=lambda: joined.append(
            rendezvous_store("127.0.0.1", port, rank=1, world_size=2, timeout=timeout).get("hello")
        )
    )
    thread.start()
    master.set("hello", "world")
    thread.join(20)
    assert joined == [b"world"]
