"""The scheduler's worker sockets when they leave the host (`--distributed-executor-backend ray`): CURVE, bounded.

Over ipc:// (every other case) the sockets live in the instance's private 0700 directory and only its own processes
reach them. Over tcp:// anyone on the network could, so there:

- every connection is CURVE (ZMTP's public-key encryption and authentication): the scheduler's sockets are the CURVE
  servers, the workers the clients, with one key pair each, made fresh per instance (`new_worker_socket_keys`) and
  handed to the workers inside their config (the Ray actor's argument), never on a command line or in a log;
- the scheduler's ZAP handler (`allow_only_workers`) admits only the workers' public key, so a peer without the
  instance's keys can neither subscribe to the plans (prompts' token ids) nor push results; a worker checks the
  scheduler's public key in the handshake;
- queues are bounded (`OFF_HOST_HWM` messages) and so are frames (`max_message_bytes`; libzmq drops the connection
  that sends a larger one).

A frame that does not decode is logged and dropped by its reader (`tokenmill.processes.decode_or_drop`).
"""

from __future__ import annotations

import hmac
import logging

import zmq
import zmq.auth.thread

from tokenmill.config import EngineConfig, WorkerSocketKeys

log = logging.getLogger("tokenmill.sockets")

ZAP_DOMAIN = "tokenmill"
# messages queued per peer and direction: the scheduler has one plan and one result in flight per step, so a worker
# never comes near it; it bounds what a stuck peer can make the other side hold
OFF_HOST_HWM = 1000
FRAME_BASE_BYTES = 64 << 20  # a plan's or result's fixed part (grammar bitmasks, logprobs, ...) with room to spare
FRAME_BYTES_PER_TOKEN = 32  # a new request's token id in a plan, its prompt logprobs in a result, with msgpack's tags


def new_worker_socket_keys() -> WorkerSocketKeys:
    """Fresh CURVE key pairs (Z85 text) for one instance's scheduler and workers."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return WorkerSocketKeys(
        server_public=server_public.decode(),
        server_secret=server_secret.decode(),
        client_public=client_public.decode(),
        client_secret=client_secret.decode(),
    )


def max_message_bytes(config: EngineConfig) -> int:
    """The largest frame a worker socket accepts: every running request's whole context, with room to spare."""
    per_step_tokens = config.scheduler.max_num_seqs * max(config.model.max_model_len, 1)
    return FRAME_BASE_BYTES + FRAME_BYTES_PER_TOKEN * per_step_tokens


class _OnlyWorkers:
    """A ZAP credentials provider admitting one public key (compared in constant time)."""

    def __init__(self, client_public: str) -> None:
        self._expected = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = hmac.compare_digest(key, self._expected)
        if not allowed:
            log.warning("refused a worker-socket connection with an unknown CURVE key")
        return allowed


def allow_only_workers(ctx: zmq.Context, keys: WorkerSocketKeys) -> zmq.auth.thread.ThreadAuthenticator:
    """Start the ZAP handler of `ctx` (before any CURVE server socket binds in it), admitting only the workers' key.
    Stop it before destroying the context."""
    authenticator = zmq.auth.thread.ThreadAuthenticator(ctx, log=log)
    authenticator.start()
    authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_OnlyWorkers(keys.client_public))
    return authenticator


def secure_socket(
    ctx: zmq.Context, kind: int, address: str, bind: bool, keys: WorkerSocketKeys, max_bytes: int
) -> zmq.Socket:
    """A CURVE socket with bounded queues and frames: the server side (it holds the secret key) binds, a client
    connects."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, OFF_HOST_HWM)
    sock.setsockopt(zmq.RCVHWM, OFF_HOST_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if bind:
        if not keys.server_secret:
            raise ValueError("binding a worker socket needs the scheduler's CURVE secret key")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret.encode())
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse, never allow
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret.encode())
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock
