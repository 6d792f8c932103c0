"""CPU work that must not run on the event loop: tokenizing and chat-template rendering, on small dedicated threads.

Tokenizing a 100k-token prompt takes ~100 ms; on the loop it would hold every other stream's next chunk that long.
In a thread it costs the loop only a GIL switch interval (~5 ms) now and then: the tokenizer's Rust batch encode
releases the GIL (`tokenizer.encode_text` uses it), and Jinja rendering is Python that yields the GIL every interval.

One thread tokenizes, so the tokenizer is never used by two threads at once (setting its truncation mutates it);
two threads render chat templates, so one slow template (bounded by its time limit) does not hold up the rest.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Offload:
    def __init__(self) -> None:
        self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-tokenizer")
        self._templates = ThreadPoolExecutor(2, thread_name_prefix="tokenmill-template")

    async def tokenize(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the tokenizer thread: anything that encodes or decodes with the tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, functools.partial(fn, *args, **kwargs))

    async def render(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a template thread."""
        return await asyncio.get_running_loop().run_in_executor(self._templates, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        self._templates.shutdown(wait=False, cancel_futures=True)
