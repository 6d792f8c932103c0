"""RestartingEngineClient over fake engines: streams survive an engine's death without a lost or repeated token, the
fresh engine gets each unfinished choice with what it had streamed, readiness says "degraded" meanwhile, and the
restart budget ends it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tokenmill.config import EngineConfig
from tokenmill.frontend.engine_client import EngineDeadError
from tokenmill.frontend.lifecycle import ServerLifecycle
from tokenmill.frontend.restarting_client import EngineHandle, RestartingEngineClient
from tokenmill.messages import EngineReady, EngineRequest, RequestOutput, SamplingParams, choice_requests

READY = EngineReady(
    num_kv_blocks=8, block_size=16, max_model_len=64, weight_bytes=0, device="cpu", dtype="float32", architecture="fake"
)


def token_at(request_id: str, position: int) -> int:
    """The fake model's output `position` of a choice: a function of nothing else, like greedy or seeded sampling."""
    return 1000 * sum(map(ord, request_id)) + position


class FakeEngine:
    """An engine client whose choices yield `token_at` one per tick; `die()` fails it as a dead process would."""

    def __init__(self) -> None:
        self.config = EngineConfig()
        self.dead_reason: str | None = None
        self.latest_stats = None
        self.summary_listener = None
        self.received: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.loaded = asyncio.Event()
        self.loaded.set()
        self.stopped = False

    def start(self) -> None:
        pass

    async def wait_ready(self, timeout: float | None = None) -> EngineReady:
        await self.loaded.wait()
        return READY

    def die(self) -> None:
        self.dead_reason = "worker0 exited with code -9"

    def close(self) -> None:
        self.dead_reason = self.dead_reason or "closed"

    async def check_health(self) -> bool:
        return self.dead_reason is None

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    @contextlib.asynccontextmanager
    async def generate_choices(self, request: EngineRequest) -> AsyncIterator[list[AsyncIterator[RequestOutput]]]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self.received.append(request)
        yield [self._choice(choice) for choice in choice_requests(request)]

    async def _choice(self, choice: EngineRequest) -> AsyncIterator[RequestOutput]:
        position = len(choice.resumed_output_token_ids)
        while position < choice.sampling.max_tokens:
            await asyncio.sleep(0.002)
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            token = token_at(choice.request_id, position)
            position += 1
            yield RequestOutput(
                choice.request_id, [token], "length" if position == choice.sampling.max_tokens else None
            )


class Engines:
    """Every fake engine launched, in order; `launch` is what the client calls to replace a dead one."""

    def __init__(self) -> None:
        self.all = [FakeEngine()]
        self.next_loaded = True

    def handle(self, engine: FakeEngine) -> EngineHandle:
        return EngineHandle(engine, lambda: setattr(engine, "stopped", True))  # type: ignore[arg-type]

    def launch(self) -> EngineHandle:
        engine = FakeEngine()
        if not self.next_loaded:
            engine.loaded.clear()
        self.all.append(engine)
        return self.handle(engine)


async def started_client(engines: Engines, lifecycle: ServerLifecycle, max_restarts: int = 3) -> RestartingEngineClient:
    client = RestartingEngineClient(engines.handle(engines.all[0]), engines.launch, lifecycle, max_restarts, 300.0)
    client.start()
    await client.wait_ready()
    return client


async def collect(stream: AsyncIterator[RequestOutput], into: list[int]) -> str | None:
    async for out in stream:
        into.extend(out.new_token_ids)
        if out.finish_reason is not None:
            return out.finish_reason
    return None


def request(n: int = 2, max_tokens: int = 40) -> EngineRequest:
    return EngineRequest(
        request_id="req", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(n=n, max_tokens=max_tokens, temperature=0)
    )


async def wait_until(condition, within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_streams_survive_a_dead_engine_without_lost_or_repeated_tokens():
    async def run() -> None:
        engines, lifecycle = Engines(), ServerLifecycle("ready")
        client = await started_client(engines, lifecycle)
        engines.next_loaded = False  # the fresh engine loads until the test lets it
        tokens: list[list[int]] = [[], []]
        async with client.generate_choices(request()) as streams:
            tasks = [asyncio.create_task(collect(stream, into)) for stream, into in zip(streams, tokens, strict=True)]
            await wait_until(lambda: len(tokens[0]) >= 5 and len(tokens[1]) >= 5)
            engines.all[0].die()
            await wait_until(lambda: len(engines.all) == 2)
            assert lifecycle.phase == "degraded" and not await client.check_health()
            streamed = [list(t) for t in tokens]
            engines.all[1].loaded.set()
            reasons = await asyncio.gather(*tasks)
        assert reasons == ["length", "length"] and lifecycle.phase == "ready" and engines.all[0].stopped
        for i, got in enumerate(tokens):
            assert got == [token_at(f"req-{i}", p) for p in range(40)]
        resumed = {r.request_id: r.resumed_output_token_ids for r in engines.all[1].received}
        assert resumed == {f"req-{i}": streamed[i] for i in range(2)}
        assert all(r.sampling.n == 1 and r.prompt_token_ids == [1, 2, 3] for r in engines.all[1].received)
        assert client.last_restart_s is not None and client.request_ids_in_flight() == []
        client.close()

    asyncio.run(run())


def test_after_the_restart_budget_the_failure_is_final():
    async def run() -> None:
        engines, lifecycle = Engines(), ServerLifecycle("ready")
        client = await started_client(engines, lifecycle, max_restarts=1)
        tokens: list[int] = []
        async with client.generate_choices(request(n=1, max_tokens=10_000)) as (stream,):
            task = asyncio.create_task(collect(stream, tokens))
            await wait_until(lambda: len(tokens) >= 3)
            engines.all[0].die()
            await wait_until(lambda: len(engines.all) == 2 and len(engines.all[1].received) == 1)
            engines.all[1].die()
            with pytest.raises(EngineDeadError):
                await task
        assert client.dead_reason is not None and len(engines.all) == 2
        with pytest.raises(EngineDeadError):
            async with client.generate_choices(request()):
                pass
        client.close()

    asyncio.run(run())


def test_a_request_aborted_while_the_engine_restarts_ends_and_is_not_resumed():
    async def run() -> None:
        engines, lifecycle = Engines(), ServerLifecycle("ready")
        client = await started_client(engines, lifecycle)
        engines.next_loaded = False
        tokens: list[int] = []
        async with client.generate_choices(request(n=1)) as (stream,):
            task = asyncio.create_task(collect(stream, tokens))
            await wait_until(lambda: len(tokens) >= 3)
            engines.all[0].die()
            await wait_until(lambda: len(engines.all) == 2)
            await client.abort(client.request_ids_in_flight())
            assert await task == "abort"
            engines.all[1].loaded.set()
            await wait_until(lambda: lifecycle.phase == "ready")
        assert engines.all[1].received == []
        client.close()

    asyncio.run(run())
