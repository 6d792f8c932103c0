"""How long a ~100k-token prompt stalls the frontend's event loop: the inter-chunk gaps of running streams while
huge prompts arrive.

8 decode streams start (short token-id prompts, each generating --decode-tokens tokens with EOS ignored). Once every
stream has --tokens-before tokens, --num-large prompts of about --large-tokens tokens each are sent at once, as text
(alternately to /v1/completions and /v1/chat/completions), so the server must render and tokenize them. They are
longer than the context and come back as 400s; the tokenization still happens first, and while it runs on the event
loop no other stream's chunk goes out. The window is from the first huge prompt's send until the last one's answer.
Reported: p50/p99/max of the streams' gaps between token chunks that overlap the window, and the same before it; and
the latency of `GET /version` polled every few milliseconds through the window, which the frontend answers without
the engine, so it shows the event loop's own stalls apart from the engine steps that CPU contention slows down.

    python scripts/bench_event_loop_stall.py                       # launches `tokenmill serve` on the default model
    python scripts/bench_event_loop_stall.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import aiohttp
import numpy as np
from benchlib.launch import launched_server
from benchlib.stats import summarize
from benchlib.streaming import (
    StreamTiming,
    completion_payload,
    http_session,
    random_token_ids,
    served_model_name,
    split_gaps_at_window,
    stream_completion,
)

WORDS = ("alpha", "river", "stone", "quantum", "mill", "token", "seven", "blue", "carbon", "lattice", "orbit", "paper")
TOKENS_PER_WORD = 4  # SmolLM2: a word plus a number of up to three digits is about four tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server; default: launch one")
    parser.add_argument(
        "--serve-args", default="--kv-cache-memory-bytes 1GiB", help="`tokenmill serve` flags when launching"
    )
    parser.add_argument("--num-streams", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument(
        "--tokens-before", type=int, default=16, help="send the huge prompts once every stream has this many tokens"
    )
    parser.add_argument("--num-large", type=int, default=4, help="how many huge prompts")
    parser.add_argument("--large-tokens", type=int, default=100_000, help="about how many tokens each one has")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for a launched server (torch threads); 1 leaves a core to the frontend",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--log",
        type=Path,
        default=Path(tempfile.gettempdir()) / "bench_event_loop_stall-server.log",
        help="the launched server's log",
    )
    return parser.parse_args(argv)


def large_text(rng: np.random.Generator, num_tokens: int) -> str:
    words = rng.choice(WORDS, size=num_tokens // TOKENS_PER_WORD)
    numbers = rng.integers(0, 1000, size=words.size)
    return " ".join(f"{w}{n}" for w, n in zip(words, numbers))


def large_request(model: str, text: str, chat: bool) -> tuple[str, bytes]:
    """(path, JSON body) of one huge prompt, encoded up front so the client's own loop does not stall either."""
    if chat:
        path, body = (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1},
        )
    else:
        path, body = "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}
    return path, json.dumps(body).encode()


async def send_large(session: aiohttp.ClientSession, url: str, path: str, body: bytes) -> tuple[int, str]:
    """POST one huge prompt; (status, the start of the answer)."""
    async with session.post(url + path, data=body, headers={"Content-Type": "application/json"}) as response:
        return response.status, (await response.text())[:160]


async def probe_loop(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[float]:
    """Latencies of GET /version, one after another with a short pause, until `stop`."""
    latencies = []
    while not stop.is_set():
        start = time.perf_counter()
        async with session.get(url + "/version") as response:
            await response.read()
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.002)
    return latencies


async def run(url: str, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    texts = [large_text(rng, args.large_tokens) for _ in range(args.num_large)]
    async with http_session() as session:
        model = await served_model_name(session, url)
        large = [large_request(model, text, chat=i % 2 == 1) for i, text in enumerate(texts)]
        await stream_completion(session, url, completion_payload(model, random_token_ids(rng, 16), 2), "warm-up")
        streams = [StreamTiming(f"stream {i}", 0.0) for i in range(args.num_streams)]
        tasks = [
            asyncio.create_task(
                stream_completion(
                    session,
                    url,
                    completion_payload(model, random_token_ids(rng, 32), args.decode_tokens),
                    timing=timing,
                )
            )
            for timing in streams
        ]
        while not all(s.num_tokens >= args.tokens_before for s in streams):
            if all(task.done() for task in tasks):
                failed = [s.error for s in streams if s.error]
                raise RuntimeError(failed[0] if failed else "the streams ended before --tokens-before")
            await asyncio.sleep(0.01)
        stop_probe = asyncio.Event()
        probe = asyncio.create_task(probe_loop(session, url, stop_probe))
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        answers = await asyncio.gather(*(send_large(session, url, path, body) for path, body in large))
        end = time.perf_counter()
        stop_probe.set()
        probe_latencies = await probe
        await asyncio.gather(*tasks)
    errors = [f"{s.label}: {s.error}" for s in streams if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed, first: {errors[0]}")
    if any(s.chunk_times[-1] < end for s in streams):
        raise RuntimeError("a stream ended inside the window; raise --decode-tokens")
    inside, before = split_gaps_at_window(streams, start, end)
    return {
        "window_s": end - start,
        "large_answers": answers,
        "gap_in_window_ms": summarize(inside, scale=1000.0) | {"max": 1000.0 * max(inside)},
        "gap_before_ms": summarize(before, scale=1000.0) | {"max": 1000.0 * max(before, default=0.0)},
        "version_probe_ms": summarize(probe_latencies, scale=1000.0) | {"max": 1000.0 * max(probe_latencies)},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    serve_args = shlex.split(args.serve_args)
    if args.server_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.server_threads)  # inherited by the server processes
    launch = nullcontext(args.base_url) if args.base_url else launched_server(serve_args, args.log)
    with launch as url:
        result = asyncio.run(run(url, args))
    inside, before = result["gap_in_window_ms"], result["gap_before_ms"]
    print(
        f"{args.num_streams} streams; {args.num_large} prompts of ~{args.large_tokens} tokens sent after "
        f"{args.tokens_before} tokens each; window {result['window_s'] * 1000:.0f} ms",
        file=sys.stderr,
    )
    for status, text in result["large_answers"]:
        print(f"  huge prompt -> {status} {text[:100]}", file=sys.stderr)
    print(
        f"inter-chunk gap while huge prompts arrive: p50 {inside['median']:.1f} ms, p99 {inside['p99']:.1f} ms, "
        f"max {inside['max']:.1f} ms (n={inside['count']})"
    )
    print(
        f"inter-chunk gap before:                    p50 {before['median']:.1f} ms, p99 {before['p99']:.1f} ms, "
        f"max {before['max']:.1f} ms (n={before['count']})"
    )
    probe = result["version_probe_ms"]
    print(
        f"GET /version latency in the window:        p50 {probe['median']:.1f} ms, p99 {probe['p99']:.1f} ms, "
        f"max {probe['max']:.1f} ms (n={probe['count']})"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
