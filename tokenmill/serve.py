"""Run one serving instance: engine processes, the HTTP server from the start, readiness, drain and an orderly stop.

The port opens as soon as the tokenizer is read, while the engine still loads its weights: /health and /ready answer
503 ("loading") and /v1/* a 503 naming the cause, until the scheduler reports EngineReady. The first SIGINT/SIGTERM
drains: new API requests get a 503 with Retry-After, /ready says "draining", requests in flight run on for up to
`--shutdown-timeout` seconds and whatever is still running then ends with finish_reason "abort" (a clean end of the
stream, never a cut connection); a second signal skips the wait. Then every process stops and the exit code is 0.
A child that dies turns /health to 503, ends in-flight requests with an error, and the instance exits with code 1
after a short grace period; with --restart-on-failure a fresh engine takes over instead and the requests in flight
resume (frontend/restarting_client.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web

from tokenmill.config import EngineConfig
from tokenmill.data_parallel import DataParallelEngines
from tokenmill.frontend.data_parallel_client import DataParallelEngineClient
from tokenmill.frontend.engine_client import AsyncEngineClient, EngineDeadError
from tokenmill.frontend.engine_protocol import EngineClient
from tokenmill.frontend.lifecycle import ServerLifecycle
from tokenmill.frontend.redaction import RedactingAccessLogger
from tokenmill.frontend.restarting_client import EngineHandle, RestartingEngineClient
from tokenmill.gc_heap import freeze_startup_heap
from tokenmill.launcher import EngineProcesses, kv_capacity_error, log_capacity

log = logging.getLogger("tokenmill.serve")

DEATH_GRACE_S = 1.0  # lets in-flight requests receive their error before the server goes away
ABORT_GRACE_S = 5.0  # after a drain's aborts: how long the aborted streams get to send their last chunk
ABORT_RETRY_S = 0.1  # aborts are re-sent this often, for requests that reached the engine after the first
T = TypeVar("T")


class ShutdownSignals:
    """SIGINT/SIGTERM: the first sets `stop` (drain) and stops admission at once, the second sets `hurry` (end
    what is still running now)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lifecycle: ServerLifecycle) -> None:
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self.lifecycle = lifecycle
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            log.warning("%s again: ending the requests in flight now", signal.Signals(sig).name)
            self.hurry.set()
        self.stop.set()
        if self.lifecycle.phase != "loading":
            self.lifecycle.phase = "draining"  # no request is admitted after the signal, however soon it comes


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """`work`'s result, or None (and `work` cancelled) if `stop` is set first."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


async def serve(config: EngineConfig) -> int:
    from tokenmill.frontend.server import build_app
    from tokenmill.frontend.tokenizer import load_tokenizer

    if config.server.restart_on_failure and config.parallel.data_parallel_size > 1:
        log.error(
            "--restart-on-failure restarts one engine: it does not combine with --data-parallel-size > 1 "
            "(which already serves on when a replica dies)"
        )
        return 1
    lifecycle = ServerLifecycle("loading")
    processes = DataParallelEngines(config)
    # connect first: the scheduler's EngineReady must not be lost
    client = (
        restarting_client(config, processes, lifecycle)
        if config.server.restart_on_failure
        else engine_client(processes)
    )
    config = processes.config
    signals = ShutdownSignals(asyncio.get_running_loop(), lifecycle)
    runner: web.AppRunner | None = None
    try:
        client.start()
        processes.start()
        log.info("loading %s; sockets in a private directory %s", config.model.served_model_name, config.ipc_dir)
        if processes.size > 1:
            log.info(
                "data parallel: %d engine replicas (sockets in %s), routing %s",
                processes.size,
                ", ".join(c.ipc_dir for c in processes.configs[1:]),
                config.parallel.data_parallel_routing,
            )
        tokenizer = await unless_stopped(asyncio.to_thread(load_tokenizer, config.model), signals.stop)
        if tokenizer is None:
            log.info("interrupted while loading")
            return 0
        runner = await open_port(config, build_app(config, client, tokenizer, lifecycle))
        ready = await unless_stopped(client.wait_ready(), signals.stop)
        if ready is None:
            log.info("interrupted while loading")
            return 0
        log_capacity(config, ready)
        if (error := kv_capacity_error(config, ready)) is not None:
            log.error("%s", error)
            return 1
        freeze_startup_heap()
        lifecycle.phase = "ready"
        log.info(
            "ready: serving %s on http://%s:%d", config.model.served_model_name, config.server.host, config.server.port
        )
        await until_stopped_or_dead(client, signals.stop)
        if client.dead_reason is not None:
            log.error("shutting down: %s", client.dead_reason)
            await asyncio.sleep(DEATH_GRACE_S)
            return 1
        await drain(client, lifecycle, config.server.shutdown_timeout_s, signals.hurry)
        return 0
    except EngineDeadError as exc:
        log.error("%s", exc)
        return 1
    finally:
        if runner is not None:
            await runner.cleanup()
        client.close()
        processes.stop()


async def open_port(config: EngineConfig, app: web.Application) -> web.AppRunner:
    access_log = logging.getLogger("aiohttp.access") if config.server.enable_log_requests else None
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=access_log,
        access_log_class=RedactingAccessLogger,
        shutdown_timeout=ABORT_GRACE_S,
    )
    await runner.setup()
    await web.TCPSite(runner, config.server.host, config.server.port).start()
    log.info(
        "listening on http://%s:%d (GET /ready answers 200 once the model is loaded)",
        config.server.host,
        config.server.port,
    )
    return runner


async def until_stopped_or_dead(client: EngineClient, stop: asyncio.Event) -> None:
    while not stop.is_set() and client.dead_reason is None:
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except asyncio.TimeoutError:
            pass


async def drain(client: EngineClient, lifecycle: ServerLifecycle, timeout_s: float, hurry: asyncio.Event) -> None:
    """Admit nothing more, let the requests in flight finish for up to `timeout_s` (or until `hurry`), then end the
    rest with finish_reason "abort" and give their streams a moment to send their last chunk and [DONE]."""
    lifecycle.phase = "draining"
    log.info(
        "draining: %d requests in flight get up to %g s to finish (--shutdown-timeout; a second signal ends them now)",
        lifecycle.in_flight,
        timeout_s,
    )
    if await lifecycle.wait_idle(timeout_s, hurry):
        log.info("shutting down: every request finished")
        return
    log.warning("shutting down: ending %d requests still in flight with finish_reason 'abort'", lifecycle.in_flight)
    deadline = time.monotonic() + ABORT_GRACE_S
    while lifecycle.in_flight and time.monotonic() < deadline and client.dead_reason is None:
        await client.abort(client.request_ids_in_flight())
        await lifecycle.wait_idle(ABORT_RETRY_S)


def restarting_client(
    config: EngineConfig, processes: DataParallelEngines, lifecycle: ServerLifecycle
) -> RestartingEngineClient:
    """--restart-on-failure: the first engine's client, and fresh engines from `config` (the one before start-up
    gave the processes their socket directory) when it fails."""
    first = EngineHandle(AsyncEngineClient(processes.config, processes.dead_child), processes.stop)
    server = config.server
    return RestartingEngineClient(
        first, functools.partial(launch_engine, config), lifecycle, server.max_restarts, server.restart_window_s
    )


def launch_engine(config: EngineConfig) -> EngineHandle:
    """A fresh engine's processes and its client (connected and started before the processes, so its EngineReady
    cannot be lost)."""
    processes = EngineProcesses(config)
    client = AsyncEngineClient(processes.config, processes.dead_child)
    client.start()
    processes.start()
    log.info("restarting: a fresh engine loads (sockets in %s)", processes.config.ipc_dir)
    return EngineHandle(client, processes.stop)


def engine_client(processes: DataParallelEngines) -> EngineClient:
    """One replica's client, or the data-parallel client over every replica (it routes each request)."""
    if processes.size == 1:
        return AsyncEngineClient(processes.config, processes.dead_child)
    return DataParallelEngineClient(
        processes.configs,
        [replica.dead_child for replica in processes.replicas],
        stop_replica=lambda rank: processes.replicas[rank].stop(),
    )


def serve_forever(config: EngineConfig) -> int:
    try:
        import uvloop

        return uvloop.run(serve(config))
    except ImportError:
        return asyncio.run(serve(config))
