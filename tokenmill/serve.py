"""Run one serving instance: engine processes, readiness handshake, the HTTP server, and an orderly stop.

HTTP is accepted only after the scheduler reports EngineReady (weights loaded, KV cache allocated). SIGINT/SIGTERM
stop everything with exit code 0; a child that dies turns /health to 503, ends in-flight requests with an error, and
the instance exits with code 1 after a short grace period.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from tokenmill.config import EngineConfig
from tokenmill.data_parallel import DataParallelEngines
from tokenmill.frontend.data_parallel_client import DataParallelEngineClient
from tokenmill.frontend.engine_client import AsyncEngineClient, EngineDeadError
from tokenmill.frontend.engine_protocol import EngineClient
from tokenmill.frontend.redaction import RedactingAccessLogger
from tokenmill.launcher import kv_capacity_error, log_capacity

log = logging.getLogger("tokenmill.serve")

DEATH_GRACE_S = 1.0  # lets in-flight requests receive their error before the server goes away
SHUTDOWN_TIMEOUT_S = 10.0  # in-flight requests get this long to finish after SIGINT/SIGTERM


async def serve(config: EngineConfig) -> int:
    from tokenmill.frontend.server import build_app
    from tokenmill.frontend.tokenizer import load_tokenizer

    processes = DataParallelEngines(config)
    config = processes.config
    client = engine_client(processes)  # connect first: the scheduler's EngineReady must not be lost
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner: web.AppRunner | None = None
    try:
        client.start()
        processes.start()
        log.info("loading %s; sockets in a private directory %s", config.model.served_model_name, config.ipc_dir)
        if processes.size > 1:
            log.info("data parallel: %d engine replicas (sockets in %s), routing %s", processes.size,
                     ", ".join(c.ipc_dir for c in processes.configs[1:]), config.parallel.data_parallel_routing)
        tokenizer_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, config.model))
        ready_task = asyncio.create_task(client.wait_ready())
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait([ready_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            log.info("interrupted while loading")
            return 0
        log_capacity(config, ready_task.result())
        if (error := kv_capacity_error(config, ready_task.result())) is not None:
            log.error("%s", error)
            return 1
        tokenizer = await tokenizer_task
        access_log = logging.getLogger("aiohttp.access") if config.server.enable_log_requests else None
        runner = web.AppRunner(build_app(config, client, tokenizer), handle_signals=False, access_log=access_log,
                               access_log_class=RedactingAccessLogger, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        await web.TCPSite(runner, config.server.host, config.server.port).start()
        log.info("serving %s on http://%s:%d", config.model.served_model_name, config.server.host, config.server.port)
        while not stop.is_set() and client.dead_reason is None:
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
        if client.dead_reason is not None:
            log.error("shutting down: %s", client.dead_reason)
            await asyncio.sleep(DEATH_GRACE_S)
            return 1
        log.info("shutting down")
        return 0
    except EngineDeadError as exc:
        log.error("%s", exc)
        return 1
    finally:
        if runner is not None:
            await runner.cleanup()
        client.close()
        processes.stop()


def engine_client(processes: DataParallelEngines) -> EngineClient:
    """One replica's client, or the data-parallel client over every replica (it routes each request)."""
    if processes.size == 1:
        return AsyncEngineClient(processes.config, processes.dead_child)
    return DataParallelEngineClient(processes.configs, [replica.dead_child for replica in processes.replicas],
                                    stop_replica=lambda rank: processes.replicas[rank].stop())


def serve_forever(config: EngineConfig) -> int:
    try:
        import uvloop

        return uvloop.run(serve(config))
    except ImportError:
        return asyncio.run(serve(config))
