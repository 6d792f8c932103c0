"""The torch.distributed rendezvous store, listening on the rendezvous host only.

`init_process_group(init_method="tcp://host:port")` makes rank 0's TCPStore listen on every interface whatever the
host, so anyone who reaches the machine could join or poison the rendezvous. Here rank 0 binds the listening socket
itself, to `host` alone, and hands its descriptor to the store; the other ranks connect as before.
"""

from __future__ import annotations

import datetime
import socket

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch's stubs do not re-export it

RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)
LISTEN_BACKLOG = 128


def listen_on(host: str, port: int) -> int:
    """A listening TCP socket on (host, port) only; its descriptor, now owned by the caller."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    return listener.detach()  # the store closes it; the Python object must not on garbage collection


def rendezvous_store(
    host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta = RENDEZVOUS_TIMEOUT
) -> TCPStore:
    """The store every rank joins: rank 0 serves it on host:port only, the others connect to it."""
    if rank == 0:
        return TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listen_on(host, port),
        )
    return TCPStore(host, port, world_size, is_master=False, timeout=timeout)
