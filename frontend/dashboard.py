"""The live dashboard: `GET /dashboard` (one HTML page, no build step, nothing fetched from elsewhere), its event
stream `GET /dashboard/stream` (server-sent events) and the same stream as JSON lines, `GET /debug/steps`, for scripts.

The scheduler sends a `StepSummary` at most every `STREAM_INTERVAL_S` while at least one stream is open (the hub
sends `WatchSteps` when the first opens and `WatchSteps(0)` when the last closes), so an unwatched engine pays only
for recording each step's token counts. Each summary is turned into JSON once, with the frontend's own rates
(throughput, TTFT, TPOT, sampled from its Prometheus registry) folded in, and offered to every open stream; the schema
is in docs/dashboard.md.

Bounded: at most `MAX_STREAMS` streams at once (then 429), and a client more than `CLIENT_BACKLOG` updates behind is
dropped rather than buffered. With `--api-key` every route needs the key: `Authorization: Bearer KEY`, or `?token=KEY`,
which on /dashboard sets an HttpOnly cookie (a MAC of the key, never the key itself) and redirects to the bare URL, so
the page's EventSource (which cannot send headers) is let in. Every comparison is constant-time. `--disable-dashboard`
leaves the three routes out.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from tokenmill.frontend.engine_protocol import EngineClient
from tokenmill.frontend.errors import APIError
from tokenmill.messages import StepSummary

log = logging.getLogger("tokenmill.frontend")

STREAM_INTERVAL_S = 0.05  # at most 20 summaries a second
MAX_STREAMS = 8  # open dashboard and /debug/steps streams, together
CLIENT_BACKLOG = 64  # updates a stream may fall behind before it is dropped (about 3 s at full rate)
KEEPALIVE_S = 15.0  # an SSE comment when nothing else was sent this long
WRITE_TIMEOUT_S = 10.0  # a client that takes longer to accept one update is gone: its connection is closed
METRICS_PERIOD_S = 0.5  # the frontend's rates are sampled at most this often (one sparkline point each)
COOKIE_NAME = "tokenmill_dashboard"
COOKIE_MAX_AGE_S = 12 * 3600  # a working day: then ?token= again
PAGE_PATH = Path(__file__).parent / "static" / "dashboard.html"
# the page's own inline script and style only: it can reach nothing but this server
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


# ---------------------------------------------------------------------------------------------------- access


def cookie_value(api_key: str) -> str:
    """What the dashboard cookie holds: a MAC of the key, so the cookie never carries the key itself."""
    return hmac.new(api_key.encode(), b"tokenmill-dashboard-cookie", hashlib.sha256).hexdigest()


def _equal(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def token_in_query(request: web.Request, api_key: str) -> bool:
    return _equal(request.query.get("token", ""), api_key)


def check_access(request: web.Request, api_key: str | None) -> None:
    """Let the request in when no key is set, or it shows the key (bearer header, `token` query parameter) or the
    dashboard cookie; else a 401."""
    if api_key is None:
        return
    given = request.headers.get("Authorization", "")
    bearer = given[len("Bearer ") :] if given.startswith("Bearer ") else ""
    # every check runs, each constant-time, so timing tells nothing about which one failed
    ok = _equal(bearer, api_key) | token_in_query(request, api_key)
    ok |= _equal(request.cookies.get(COOKIE_NAME, ""), cookie_value(api_key))
    if not ok:
        raise APIError(
            401, "Invalid or missing API key: open /dashboard?token=<key>, or send `Authorization: Bearer <key>`."
        )


# ---------------------------------------------------------------------------------------------------- the feed


def read_totals(registry) -> dict[str, float]:
    """The registry's running totals the dashboard needs, by sample name (label values summed)."""
    totals: dict[str, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _total(totals: dict[str, float], name: str) -> float:
    return totals.get(name + "_total", totals.get(name, 0.0))


class FrontendRates:
    """Throughput, TTFT and TPOT over the last `METRICS_PERIOD_S` or more, from the frontend's own metrics, plus the
    /metrics values the dashboard shows next to the scheduler's."""

    def __init__(self, metrics: Any, period_s: float = METRICS_PERIOD_S) -> None:
        self.metrics = metrics
        self.period_s = period_s
        self._previous: tuple[float, dict[str, float]] | None = None
        self.current: dict[str, Any] | None = None

    def sample(self) -> dict[str, Any]:
        now = time.monotonic()
        if self.current is not None and self._previous is not None and now - self._previous[0] < self.period_s:
            return self.current
        totals = read_totals(self.metrics.registry)
        rates: dict[str, Any] = {
            "time": time.time(),
            "generation_tokens_per_s": None,
            "prompt_tokens_per_s": None,
            "ttft_s": None,
            "tpot_s": None,
        }
        if self._previous is not None:
            then, before = self._previous
            elapsed = max(now - then, 1e-9)

            def delta(name: str) -> float:
                return totals.get(name, 0.0) - before.get(name, 0.0)

            def mean(prefix: str) -> float | None:
                count = delta(prefix + "_count")
                return delta(prefix + "_sum") / count if count > 0 else None

            rates["generation_tokens_per_s"] = delta("vllm:generation_tokens_total") / elapsed
            rates["prompt_tokens_per_s"] = delta("vllm:prompt_tokens_total") / elapsed
            rates["ttft_s"] = mean("vllm:time_to_first_token_seconds")
            rates["tpot_s"] = mean("vllm:inter_token_latency_seconds")
        rates["metrics"] = {  # as /metrics shows them now
            "num_requests_running": _total(totals, "vllm:num_requests_running"),
            "num_requests_waiting": _total(totals, "vllm:num_requests_waiting"),
            "kv_cache_usage_perc": _total(totals, "vllm:kv_cache_usage_perc"),
            "prefix_cache_queries": _total(totals, "vllm:prefix_cache_queries"),
            "prefix_cache_hits": _total(totals, "vllm:prefix_cache_hits"),
            "num_preemptions": _total(totals, "vllm:num_preemptions"),
            "requests_finished": _total(totals, "vllm:request_success"),
        }
        self._previous = (now, totals)
        self.current = rates
        return rates


STEP_FIELDS = ("step_id", "prefill_tokens", "decode_tokens", "num_requests", "step_time_s", "preemptions")


def summary_json(summary: StepSummary, frontend: dict[str, Any], model_name: str) -> bytes:
    """One update as the streams send it (docs/dashboard.md has the schema)."""
    free = summary.num_free_blocks - summary.num_cached_blocks
    used = summary.num_blocks - summary.num_free_blocks
    queries, hits = summary.prefix_cache_queries, summary.prefix_cache_hits
    return msgspec.json.encode(
        {
            "engine": summary.engine,
            "model": model_name,
            "step_id": summary.step_id,
            "time": summary.time,
            "steps": [dict(zip(STEP_FIELDS, step)) for step in summary.steps],
            "num_running": summary.num_running,
            "num_waiting": summary.num_waiting,
            "queue": [
                {
                    "request_id": e.request_id,
                    "status": "running" if e.running else "waiting",
                    "prompt_computed": e.prompt_computed,
                    "prompt_tokens": e.prompt_tokens,
                    "output_tokens": e.output_tokens,
                    "max_tokens": e.max_tokens,
                    "priority": e.priority,
                    "preemptions": e.preemptions,
                    "color": e.color,
                }
                for e in summary.queue
            ],
            "blocks": {
                "num_blocks": summary.num_blocks,
                "block_size": summary.block_size,
                "free": free,
                "cached": summary.num_cached_blocks,
                "used": used,
                "kv_cache_usage": summary.kv_cache_usage,
                "map": summary.block_map,
            },  # bytes: base64 in JSON
            "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None},
            "num_preemptions": summary.num_preemptions,
            "summary_time_s": summary.summary_time_s,
            "frontend": frontend,
        }
    )


class Subscriber:
    """One open stream's backlog: updates wait here until its handler writes them; past CLIENT_BACKLOG it is
    dropped."""

    def __init__(self, backlog: int = CLIENT_BACKLOG) -> None:
        self.backlog = backlog
        self.updates: deque[bytes] = deque()
        self.dropped = False
        self.closed = False  # the server is shutting down
        self._wakeup = asyncio.Event()

    def offer(self, payload: bytes) -> None:
        if self.dropped:
            return
        if len(self.updates) >= self.backlog:
            self.dropped = True
            self.updates.clear()
        else:
            self.updates.append(payload)
        self._wakeup.set()

    def close(self) -> None:
        self.closed = True
        self._wakeup.set()

    async def take(self, timeout_s: float) -> list[bytes]:
        """Every update waiting (after waiting up to timeout_s for one); [] on timeout or once dropped."""
        if not self.updates and not self.dropped and not self.closed:
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        self._wakeup.clear()
        updates = list(self.updates)
        self.updates.clear()
        return updates


class DashboardHub:
    """Fans the engine's summaries out to the open streams, and turns the scheduler's summaries on and off."""

    def __init__(self, engine: EngineClient, metrics: Any, model_name: str, max_streams: int = MAX_STREAMS) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_streams = max_streams
        self.rates = FrontendRates(metrics)
        self.subscribers: set[Subscriber] = set()
        self.latest: dict[int, bytes] = {}  # per engine: its last update, for a stream that opens while others run
        self.num_updates = 0
        self._tasks: set[asyncio.Task] = set()
        engine.summary_listener = self.on_summary

    def on_summary(self, summary: StepSummary) -> None:
        if not self.subscribers:
            return
        payload = summary_json(summary, self.rates.sample(), self.model_name)
        self.latest[summary.engine] = payload
        self.num_updates += 1
        for subscriber in self.subscribers:
            subscriber.offer(payload)

    def subscribe(self) -> Subscriber:
        if len(self.subscribers) >= self.max_streams:
            raise APIError(
                429,
                f"Too many dashboard streams are open ({self.max_streams}); close one and retry.",
                headers={"Retry-After": "5"},
            )
        subscriber = Subscriber()
        for payload in self.latest.values():
            subscriber.offer(payload)
        self.subscribers.add(subscriber)
        if len(self.subscribers) == 1:
            self._watch(STREAM_INTERVAL_S)
        return subscriber

    def close(self) -> None:
        """End every stream (the server is shutting down)."""
        for subscriber in self.subscribers:
            subscriber.close()

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)
        if not self.subscribers:
            self.latest.clear()  # stale by the time anyone looks again
            self._watch(0.0)

    def _watch(self, interval_s: float) -> None:
        """Tell the engine (sent in order: zmq keeps the order of sends on one socket)."""
        task = asyncio.ensure_future(self.engine.watch_steps(interval_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


# ---------------------------------------------------------------------------------------------------- routes

HUB_KEY = web.AppKey("dashboard_hub", DashboardHub)
_page_cache: list[bytes] = []


def page_html() -> bytes:
    if not _page_cache:
        _page_cache.append(PAGE_PATH.read_bytes())
    return _page_cache[0]


def add_dashboard_routes(
    app: web.Application, engine: EngineClient, metrics: Any, model_name: str, api_key: str | None
) -> DashboardHub:
    hub = DashboardHub(engine, metrics, model_name)
    app[HUB_KEY] = hub

    async def close_streams(app: web.Application) -> None:
        hub.close()

    app.on_shutdown.append(close_streams)

    async def page(request: web.Request) -> web.StreamResponse:
        check_access(request, api_key)
        if api_key is not None and token_in_query(request, api_key):
            # the key travels once, in this URL: swap it for the cookie and drop it from the address bar
            response = web.Response(status=303, headers={"Location": "/dashboard", "Cache-Control": "no-store"})
            # Secure when the page came over TLS (a plain-HTTP instance must still be able to set it)
            response.set_cookie(
                COOKIE_NAME,
                cookie_value(api_key),
                httponly=True,
                samesite="Strict",
                path="/",
                max_age=COOKIE_MAX_AGE_S,
                secure=request.secure,
            )
            return response
        return web.Response(
            body=page_html(),
            content_type="text/html",
            charset="utf-8",
            headers={
                "Cache-Control": "no-store",
                "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer",
            },
        )

    async def event_stream(request: web.Request) -> web.StreamResponse:
        check_access(request, api_key)
        return await _stream(
            hub,
            request,
            "text/event-stream",
            b"retry: 2000\n\n",
            lambda payload: b"data: " + payload + b"\n\n",
            b": keepalive\n\n",
            b'event: dropped\ndata: {"reason": "too slow"}\n\n',
            None,
        )

    async def json_lines(request: web.Request) -> web.StreamResponse:
        check_access(request, api_key)
        limit = _limit(request)
        return await _stream(
            hub, request, "application/x-ndjson", b"", lambda payload: payload + b"\n", None, None, limit
        )

    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/stream", event_stream)
    app.router.add_get("/debug/steps", json_lines)
    return hub


def _limit(request: web.Request) -> int | None:
    text = request.query.get("limit")
    if text is None:
        return None
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        raise APIError(
            400, f"`limit` must be a positive integer (updates to send before ending), got {text!r}.", "limit"
        )
    return limit


async def _stream(
    hub: DashboardHub,
    request: web.Request,
    content_type: str,
    preamble: bytes,
    frame,
    keepalive: bytes | None,
    dropped: bytes | None,
    limit: int | None,
) -> web.StreamResponse:
    subscriber = hub.subscribe()  # 429 past the cap, before any header is sent
    response = web.StreamResponse(
        headers={"Content-Type": content_type, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    sent = 0

    async def write(data: bytes) -> None:
        await asyncio.wait_for(response.write(data), WRITE_TIMEOUT_S)

    try:
        await response.prepare(request)
        if preamble:
            await write(preamble)
        while (limit is None or sent < limit) and not subscriber.closed:
            updates = await subscriber.take(KEEPALIVE_S)
            if subscriber.dropped:
                log.info(
                    "dropped a dashboard stream (%s) more than %d updates behind", request.path, subscriber.backlog
                )
                if dropped is not None:
                    await write(dropped)
                break
            if not updates and keepalive is not None:
                await write(keepalive)
            for payload in updates[: None if limit is None else limit - sent]:
                await write(frame(payload))
                sent += 1
        await response.write_eof()
    except (ConnectionError, asyncio.TimeoutError):
        log.info("closed a dashboard stream (%s): the client went away or stopped reading", request.path)
        if request.transport is not None:
            request.transport.close()
    finally:
        hub.unsubscribe(subscriber)
    return response
