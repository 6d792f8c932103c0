"""Stream one `/v1/completions` request and time it: when it was sent, when each chunk carrying tokens arrived.

Prompts are token-id lists (the completions API takes them as they are), so a benchmark controls prompt lengths
exactly. `return_token_ids` makes every chunk carry its token ids, so a token whose text is held back by the
detokenizer (a partial UTF-8 character) still counts as arriving; TTFT is the first such chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np


@dataclass
class StreamTiming:
    """One streamed request. Times are `time.perf_counter()` seconds, comparable across requests of one run."""

    label: str
    sent_at: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_num_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # from the final usage chunk
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    def itl_intervals(self) -> list[tuple[float, float]]:
        """(start, end) of every gap between consecutive token chunks."""
        return list(zip(self.chunk_times, self.chunk_times[1:]))


def split_gaps_at_window(streams: list[StreamTiming], start: float, end: float) -> tuple[list[float], list[float]]:
    """The streams' token gaps that overlap [start, end], and those that ended at or before start (the baseline).
    Gaps after the window are in neither list."""
    inside, before = [], []
    for stream in streams:
        for gap_start, gap_end in stream.itl_intervals():
            if gap_end > start and gap_start < end:
                inside.append(gap_end - gap_start)
            elif gap_end <= start:
                before.append(gap_end - gap_start)
    return inside, before


def completion_payload(model: str, prompt_token_ids: list[int], max_tokens: int, **extra) -> dict:
    """A streamed greedy completion that runs to exactly max_tokens (EOS ignored) and reports usage at the end."""
    return {
        "model": model,
        "prompt": prompt_token_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def stream_completion(
    session: aiohttp.ClientSession, base_url: str, payload: dict, label: str = "", timing: StreamTiming | None = None
) -> StreamTiming:
    """POST the payload and read its SSE stream to the end, recording chunk arrival times.

    Pass `timing` to watch a request while it streams (its lists grow as chunks arrive)."""
    timing = timing or StreamTiming(label=label, sent_at=time.perf_counter())
    timing.sent_at = time.perf_counter()
    async with session.post(base_url + "/v1/completions", json=payload) as response:
        if response.status != 200:
            timing.error = f"HTTP {response.status}: {(await response.text())[:300]}"
            return timing
        async for raw_line in response.content:
            line = raw_line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            arrived = time.perf_counter()
            chunk = json.loads(line[len(b"data: ") :])
            if "error" in chunk:
                timing.error = json.dumps(chunk["error"])[:300]
                continue
            for choice in chunk.get("choices", []):
                num_tokens = len(choice.get("token_ids") or [])
                if num_tokens:
                    timing.chunk_times.append(arrived)
                    timing.chunk_num_tokens.append(num_tokens)
                if choice.get("finish_reason"):
                    timing.finish_reason = choice["finish_reason"]
            usage = chunk.get("usage")
            if usage:
                timing.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return timing


def random_token_ids(rng: np.random.Generator, length: int, low: int = 1000, high: int = 40000) -> list[int]:
    """Random ordinary-vocabulary token ids (SmolLM2's special tokens sit below 1000; its vocabulary is 49,152)."""
    return rng.integers(low, high, size=length).tolist()


async def served_model_name(session: aiohttp.ClientSession, base_url: str) -> str:
    """The model name the server answers to (the first of /v1/models)."""
    async with session.get(base_url + "/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


def http_session(timeout_s: float = 1800.0) -> aiohttp.ClientSession:
    """A session without a connection cap, so every request of a burst is really in flight at once."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout_s)
    )
