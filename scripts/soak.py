"""Soak a tokenmill server with mixed traffic for a while and report what production operators watch.

Traffic, drawn at random per request: plain and streamed completions, streamed chat with usage, n=2, structured
outputs (a JSON schema), client aborts (a stream dropped after a few chunks) and deadlines (`timeout` in the body).
`--concurrency` clients loop until `--duration` seconds have passed. The report: requests by kind and status, p50/p99
latency, the RSS of every server process (frontend, scheduler, workers) after the warm-up and at the end, and leaked
KV blocks (after the run the running and waiting queues must drain and KV usage return to 0, read from /metrics).

    python scripts/soak.py --duration 1800 --concurrency 8 --serve-args "--kv-cache-memory-bytes 512MiB"
    python scripts/soak.py --base-url http://127.0.0.1:8000 --server-pid 1234 --duration 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
from benchlib.launch import launched_server
from benchlib.stats import summarize
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = [
    "Once upon a time, in a land far away,",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Explain how a bicycle works in one paragraph.",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
KINDS = ("completion", "completion_stream", "chat_stream", "n2", "structured", "abort", "deadline")
DRAIN_TIMEOUT_S = 60.0


@dataclass
class SoakResults:
    statuses: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, status) -> requests
    latencies: list[float] = field(default_factory=list)  # seconds, requests that ended 200


def request_body(kind: str, model: str, rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    """(path, JSON body) of one request of `kind`."""
    prompt = rng.choice(PROMPTS)
    tokens = rng.randint(max(1, max_tokens // 4), max_tokens)
    if kind in ("chat_stream", "structured"):
        body: dict = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}
        if kind == "chat_stream":
            body.update(stream=True, stream_options={"include_usage": True})
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        return "/v1/chat/completions", body
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": rng.choice([0.0, 0.8])}
    if kind in ("completion_stream", "abort", "deadline"):
        body.update(stream=True, stream_options={"include_usage": True})
    if kind == "n2":
        body["n"] = 2
    if kind == "deadline":  # a deadline shorter than the request: it ends early with what it has
        body.update(max_tokens=max_tokens * 4, ignore_eos=True, timeout=rng.uniform(0.2, 1.5))
    return "/v1/completions", body


async def send_one(session: aiohttp.ClientSession, url: str, kind: str, body: dict) -> str:
    """Run one request; returns its status ("200", "503", ..., or "aborted" for a stream this client dropped)."""
    async with session.post(url, json=body) as response:
        if response.status != 200 or not body.get("stream"):
            await response.read()
            return str(response.status)
        chunks = 0
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            chunks += 1
            if kind == "abort" and chunks >= 3:
                return "aborted"  # leaving the block closes the connection: the server must abort the request
            if line.startswith(b'data: {"error"'):
                return "stream_error"
        return "200"


async def client_loop(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    end: float,
    seed: int,
    max_tokens: int,
    results: SoakResults,
    progress: bool = False,
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < end:
        kind = rng.choice(KINDS)
        path, body = request_body(kind, model, rng, max_tokens)
        start = time.monotonic()
        try:
            status = await send_one(session, base_url + path, kind, body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            status = f"client_error:{type(exc).__name__}"
        results.statuses[(kind, status)] += 1
        if progress:
            print(f"{time.monotonic() - start:7.2f} s  {kind} {status}", file=sys.stderr, flush=True)
        if status == "200":
            results.latencies.append(time.monotonic() - start)


def metric_values(text: str) -> dict[str, float]:
    """/metrics samples by name (the model_name label dropped; one engine)."""
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


async def engine_gauges(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with session.get(base_url + "/metrics") as response:
        values = metric_values(await response.text())
    return {
        name: values.get(f"vllm:{name}", float("nan"))
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    }


async def drained_gauges(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The queue and KV gauges once they reach zero, or as they stand after DRAIN_TIMEOUT_S (a leak)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        gauges = await engine_gauges(session, base_url)
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.5)


def process_rss(root_pid: int) -> dict[str, int]:
    """RSS in bytes of the server process and every process below it, keyed `name[pid]`."""
    root = psutil.Process(root_pid)
    rss = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            rss[f"{proc.name()}[{proc.pid}]"] = proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return rss


def server_pid(args: argparse.Namespace) -> int | None:
    """The given --server-pid, or the `tokenmill serve` this script launched (its only child)."""
    if args.server_pid is not None:
        return args.server_pid
    children = psutil.Process().children()
    return children[0].pid if children else None


async def soak(args: argparse.Namespace, base_url: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        async with session.get(base_url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        pid = server_pid(args)
        results = SoakResults()
        warmup_end = time.monotonic() + args.warmup
        await asyncio.gather(
            *(
                client_loop(session, base_url, model, warmup_end, 1000 + i, args.max_tokens, SoakResults())
                for i in range(args.concurrency)
            )
        )
        rss_start = process_rss(pid) if pid else {}
        end = time.monotonic() + args.duration
        await asyncio.gather(
            *(
                client_loop(session, base_url, model, end, i, args.max_tokens, results, args.progress)
                for i in range(args.concurrency)
            )
        )
        gauges = await drained_gauges(session, base_url)
        rss_end = process_rss(pid) if pid else {}
    return report(args, results, rss_start, rss_end, gauges)


def report(
    args: argparse.Namespace,
    results: SoakResults,
    rss_start: dict[str, int],
    rss_end: dict[str, int],
    gauges: dict[str, float],
) -> dict:
    by_status: Counter[str] = Counter()
    for (_, status), count in results.statuses.items():
        by_status[status] += count
    latency = summarize(results.latencies)
    rss = {
        name: {
            "start_mib": rss_start[name] / 2**20,
            "end_mib": rss_end.get(name, 0) / 2**20,
            "growth_pct": 100.0 * (rss_end.get(name, 0) - rss_start[name]) / rss_start[name],
        }
        for name in rss_start
    }
    return {
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "requests": sum(by_status.values()),
        "by_status": dict(by_status),
        "by_kind": {f"{kind} {status}": n for (kind, status), n in sorted(results.statuses.items())},
        "num_5xx": sum(n for status, n in by_status.items() if status.startswith("5")),
        "latency_p50_s": latency["median"],
        "latency_p99_s": latency["p99"],
        "rss": rss,
        "after_drain": gauges,
        "leaked_kv": gauges["kv_cache_usage_perc"] != 0.0,
        "stuck_requests": gauges["num_requests_running"] + gauges["num_requests_waiting"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="soak this server (default: launch one)")
    parser.add_argument("--server-pid", type=int, default=None, help="with --base-url: the server's pid, for RSS")
    parser.add_argument(
        "--serve-args",
        default="--kv-cache-memory-bytes 256MiB --max-model-len 1024",
        help="arguments of the launched `tokenmill serve`",
    )
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of measured traffic")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of traffic before the RSS baseline")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=600.0, help="client-side limit per request")
    parser.add_argument("--progress", action="store_true", help="print every request's latency, kind and status")
    parser.add_argument("--output", type=Path, default=None, help="also write the report here as JSON")
    parser.add_argument("--log", type=Path, default=Path("soak-server.log"), help="the launched server's log")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launch = nullcontext(args.base_url) if args.base_url else launched_server(shlex.split(args.serve_args), args.log)
    with launch as base_url:
        result = asyncio.run(soak(args, base_url))
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    healthy = result["num_5xx"] == 0 and not result["leaked_kv"] and result["stuck_requests"] == 0
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
