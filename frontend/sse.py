"""Server-sent events for streamed responses: `data: {json}\n\n` chunks, ending with `data: [DONE]\n\n`.

`stream_deltas` waits for the first delta before sending headers, so a request the engine rejects still gets a plain
JSON error with its status; an error after that travels as an error event. A client that goes away ends the stream,
which closes the deltas and so aborts the engine requests behind them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import msgspec
from aiohttp import web

from tokenmill.frontend.errors import APIError
from tokenmill.frontend.outputs import ChoiceDelta

log = logging.getLogger("tokenmill.frontend")

DONE = b"data: [DONE]\n\n"


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: bytes) -> None:
    await response.write(b"data: " + payload + b"\n\n")


async def stream_deltas(
    request: web.Request,
    deltas: AsyncIterator[ChoiceDelta],
    render: Callable[[ChoiceDelta], bytes | None],
    preamble: Callable[[], list[bytes]] = list,
    epilogue: Callable[[], bytes | None] = lambda: None,
) -> web.StreamResponse:
    """Send `preamble()`, then `render(delta)` for each delta (None: nothing to send), then `epilogue()` (also after
    an error event)."""
    async with aclosing(deltas):
        first = await anext(deltas)
        response = await open_event_stream(request)
        try:
            try:
                for payload in preamble():
                    await send_event(response, payload)
                delta: ChoiceDelta | None = first
                while delta is not None:
                    payload = render(delta)
                    if payload is not None:
                        await send_event(response, payload)
                    delta = await anext(deltas, None)
            except APIError as error:
                await send_event(response, msgspec.json.encode(error.body()))
            tail = epilogue()  # usage: sent after an error too, so what was generated is billed
            if tail is not None:
                await send_event(response, tail)
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:
            log.debug("client went away during %s", request.path)
    return response
