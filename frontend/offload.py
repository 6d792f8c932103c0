"""CPU work that must not run on the event loop: tokenizing and chat-template rendering, on small dedicated threads.

Tokenizing a 100k-token prompt takes ~100 ms; on the loop it would hold every other stream's next chunk that long.
In a thread it costs the loop only a GIL switch interval (~5 ms) now and then: the tokenizer's Rust batch encode
releases the GIL (`tokenizer.encode_text` uses it), and Jinja rendering is Python that yields the GIL every interval.

One thread tokenizes, so the tokenizer is never used by two threads at once (setting its truncation mutates it);
two threads render chat templates, so one slow template (bounded by its time limit) does not hold up the rest.

The side endpoints (`/tokenize`, `/detokenize`) run on a thread of their own, with their own copy of the tokenizer,
and at most `SIDE_QUEUE_LIMIT` of their jobs wait or run at once (then 429): a flood of them cannot delay the `/v1`
requests' tokenizing or template rendering by one job.
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenmill.frontend.errors import RETRY_AFTER_S, APIError

T = TypeVar("T")

SIDE_QUEUE_LIMIT = 16  # side-endpoint jobs waiting or running at once


class Offload:
    def __init__(self, side_queue_limit: int = SIDE_QUEUE_LIMIT) -> None:
        self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-tokenizer")
        self._templates = ThreadPoolExecutor(2, thread_name_prefix="tokenmill-template")
        self._side = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-side")
        self._side_limit = side_queue_limit
        self._side_jobs = 0  # counted on the event loop
        self._side_tokenizer: Any = None

    async def tokenize(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the tokenizer thread: anything that encodes or decodes with the tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, functools.partial(fn, *args, **kwargs))

    async def render(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a template thread."""
        return await asyncio.get_running_loop().run_in_executor(self._templates, functools.partial(fn, *args, **kwargs))

    async def side(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the side endpoints' thread; a 429 when `side_queue_limit` jobs are already there.
        A job counts until it has run or been cancelled before starting, even if its caller went away."""
        if self._side_jobs >= self._side_limit:
            raise APIError(
                429,
                f"Too many /tokenize and /detokenize requests in flight (limit {self._side_limit}); retry shortly.",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        loop = asyncio.get_running_loop()
        job = self._side.submit(functools.partial(fn, *args, **kwargs))
        self._side_jobs += 1
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._side_job_done))
        return await asyncio.wrap_future(job)

    def _side_job_done(self) -> None:
        self._side_jobs -= 1

    async def side_tokenizer(self, tokenizer: Any) -> Any:
        """The side thread's own copy of `tokenizer`, so the two threads never share one. Copied once, on the
        tokenizer thread: nothing else uses the original while it is read."""
        if self._side_tokenizer is None:
            self._side_tokenizer = await self.tokenize(copy.deepcopy, tokenizer)
        return self._side_tokenizer

    def close(self) -> None:
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        self._templates.shutdown(wait=False, cancel_futures=True)
        self._side.shutdown(wait=False, cancel_futures=True)
