"""A streaming completion read in a background thread, chunk by chunk, for the operations tests (drain, restart)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import requests


@dataclass
class StreamRecord:
    """What one streamed completion delivered: its text, token count, finish reason and whether [DONE] came."""

    status: int | None = None
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False  # the stream ended with `data: [DONE]`
    error: str | None = None  # a cut connection, a timeout, an error chunk
    first_chunk: threading.Event = field(default_factory=threading.Event)
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() of each text chunk

    @property
    def text(self) -> str:
        return "".join(self.texts)


def read_stream(url: str, body: dict, record: StreamRecord, timeout_s: float = 120) -> None:
    try:
        with requests.post(
            f"{url}/v1/completions",
            stream=True,
            timeout=timeout_s,
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as response:
            record.status = response.status_code
            for line in response.iter_lines():
                if line.startswith(b"data: "):
                    read_event(line[len(b"data: ") :], record)
    except requests.RequestException as exc:
        record.error = repr(exc)
    finally:
        record.first_chunk.set()  # never leave a waiter hanging


def read_event(data: bytes, record: StreamRecord) -> None:
    if data == b"[DONE]":
        record.done = True
        return
    event = json.loads(data)
    if "error" in event:
        record.error = json.dumps(event["error"])
    for choice in event.get("choices", []):
        record.texts.append(choice["text"])
        record.chunk_times.append(time.monotonic())
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
        record.first_chunk.set()
    if event.get("usage"):
        record.completion_tokens = event["usage"]["completion_tokens"]


def start_streams(url: str, bodies: list[dict]) -> tuple[list[threading.Thread], list[StreamRecord]]:
    records = [StreamRecord() for _ in bodies]
    threads = [
        threading.Thread(target=read_stream, args=(url, body, record), daemon=True)
        for body, record in zip(bodies, records, strict=True)
    ]
    for thread in threads:
        thread.start()
    return threads, records
