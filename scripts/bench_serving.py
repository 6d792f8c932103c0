"""Benchmark an OpenAI-compatible server (tokenmill or any other engine) the way vLLM's benchmark_serving.py does.

Requests stream (`stream: true`, `stream_options.include_usage`); the client times the first token's chunk
(TTFT; a completion's first chunk counts even when its text is empty), the gaps between later text chunks (ITL) and
the whole request (E2E), and counts tokens from the final `usage` chunk. TPOT is (E2E - TTFT) / (output tokens - 1)
per request. Arrivals are Poisson at `--request-rate` (gamma-distributed with `--burstiness` != 1), capped by
`--max-concurrency`; `--sweep` repeats the run at several concurrencies and plots throughput and latency against
concurrency. Results land in
`bench_results/<UTC timestamp>-<name>/`: results.json, the PNG plots, and command.txt.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 128 \\
        --input-len 64:512 --output-len 16:256 --max-concurrency 32
    python scripts/bench_serving.py --launch --serve-args "--max-num-seqs 32" --sweep 1,4,16,32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from benchlib.launch import launched_server
from benchlib.plots import plot_latency_cdfs, plot_sweep
from benchlib.results import args_as_json, make_results_dir, save_json
from benchlib.stats import format_table, latency_rows, summarize
from benchlib.workload import BenchRequest, LengthRange, build_workload, load_tokenizer
from tqdm import tqdm

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 6 * 3600


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Target:
    """Where and how requests are sent."""

    url: str  # base URL + endpoint
    model: str
    chat: bool
    token_id_prompts: bool
    ignore_eos: bool
    temperature: float

    def payload(self, request: BenchRequest) -> dict:
        body: dict = {
            "model": self.model,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.chat:
            body["messages"] = [{"role": "user", "content": request.prompt_text}]
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.prompt_ids if self.token_id_prompts else request.prompt_text
            body["max_tokens"] = request.output_len
        return body


def chunk_text(chunk: dict, chat: bool) -> str:
    """The text a streamed chunk carries (empty for role-only, finish-only and usage chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(session: aiohttp.ClientSession, target: Target, request: BenchRequest) -> RequestResult:
    """Send one streamed request and time its chunks."""
    result = RequestResult(expected_output_tokens=request.output_len)
    started = time.perf_counter()
    last_chunk = started
    try:
        async with session.post(target.url, json=target.payload(request)) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for raw_line in response.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return result
                now = time.perf_counter()
                text = chunk_text(chunk, target.chat)
                # a completion's first chunk is its first token even when the text is empty (a token ending inside
                # a UTF-8 character, or one a random-weight model decodes to nothing); a chat stream's first chunk
                # may carry only the role, before any token
                first_token = text or (not target.chat and chunk.get("choices"))
                if result.ttft_s == 0.0 and first_token:
                    result.ttft_s = now - started
                    last_chunk = now
                elif text:
                    result.itl_s.append(now - last_chunk)
                    last_chunk = now
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.latency_s = time.perf_counter() - started
        if result.output_tokens == 0:
            result.error = "the stream carried no usage (does the server honour stream_options.include_usage?)"
        else:
            result.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


def arrival_gaps(num_requests: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds to wait before each request: 0 at an infinite rate, else gamma(burstiness) gaps (Poisson at 1)."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)


async def run_requests(
    target: Target,
    requests: list[BenchRequest],
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    desc: str,
) -> tuple[list[RequestResult], float]:
    """Send every request on its arrival schedule, at most `max_concurrency` in flight; (results, duration)."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    bar = tqdm(total=len(requests), desc=desc, dynamic_ncols=True, file=sys.stderr)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(request: BenchRequest) -> RequestResult:
            async with semaphore if semaphore is not None else nullcontext():
                result = await send_request(session, target, request)
            bar.update(1)
            return result

        tasks = []
        started = time.perf_counter()
        for request, gap in zip(requests, arrival_gaps(len(requests), request_rate, burstiness, seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    bar.close()
    return list(results), duration


def summarize_run(results: list[RequestResult], duration_s: float) -> dict:
    """Throughputs and latency statistics over the successful requests (latencies in ms)."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in results if not r.success})
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors[:10],
        "output_len_mismatches": sum(r.output_tokens != r.expected_output_tokens for r in done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": summarize([r.ttft_s for r in done], 1e3),
        "tpot_ms": summarize([r.tpot_s for r in done if r.tpot_s is not None], 1e3),
        "itl_ms": summarize([gap for r in done for gap in r.itl_s], 1e3),
        "e2el_ms": summarize([r.latency_s for r in done], 1e3),
    }


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    done = [r for r in results if r.success]
    return {
        "ttft_ms": [r.ttft_s * 1e3 for r in done],
        "tpot_ms": [r.tpot_s * 1e3 for r in done if r.tpot_s is not None],
        "itl_ms": [gap * 1e3 for r in done for gap in r.itl_s],
        "e2el_ms": [r.latency_s * 1e3 for r in done],
    }


def summary_table(title: str, summary: dict) -> str:
    rows = [
        ("Successful requests:", str(summary["completed"])),
        ("Failed requests:", str(summary["failed"])),
        ("Benchmark duration (s):", f"{summary['duration_s']:.2f}"),
        ("Total input tokens:", str(summary["total_input_tokens"])),
        ("Total generated tokens:", str(summary["total_output_tokens"])),
        ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        rows += latency_rows(name, summary[key])
    return format_table(title, rows)


async def served_model_name(base_url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(base_url + "/v1/models") as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    target.add_argument("--model", default="", help="model name to send (default: the first of /v1/models)")
    target.add_argument("--launch", action="store_true", help="start `tokenmill serve` on a free port, stop it after")
    target.add_argument("--serve-args", default="", help="arguments for the launched `tokenmill serve` (one string)")
    work = parser.add_argument_group("workload")
    work.add_argument("--tokenizer", default="", help="tokenizer dir, .gguf or hub id (default: tokenmill's model)")
    work.add_argument("--num-prompts", type=int, default=128)
    work.add_argument(
        "--input-len",
        type=LengthRange.parse,
        default=LengthRange(64, 512),
        help="prompt tokens: N, or LOW:HIGH drawn uniformly",
    )
    work.add_argument(
        "--output-len",
        type=LengthRange.parse,
        default=LengthRange(16, 256),
        help="max_tokens per request: N, or LOW:HIGH drawn uniformly",
    )
    work.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="token-id prompts (exact lengths; /v1/completions only) or decoded text",
    )
    work.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--seed", type=int, default=0)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--sweep", default="", help="comma-separated max concurrencies to run in turn, e.g. 1,4,16,32")
    load.add_argument("--num-warmup", type=int, default=4, help="requests sent (and discarded) before timing")
    out = parser.add_argument_group("output")
    out.add_argument("--result-dir", default="bench_results")
    out.add_argument("--name", default="serving")
    args = parser.parse_args(argv)
    if args.endpoint == CHAT and args.prompt_format == "ids":
        args.prompt_format = "text"  # chat messages are text
    return args


async def benchmark(args: argparse.Namespace, base_url: str, folder: Path) -> dict:
    tokenizer = load_tokenizer(args.tokenizer)
    model = args.model or await served_model_name(base_url)
    target = Target(
        base_url.rstrip("/") + args.endpoint,
        model,
        args.endpoint == CHAT,
        args.prompt_format == "ids",
        args.ignore_eos,
        args.temperature,
    )
    with_text = args.prompt_format == "text"
    levels = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.max_concurrency]

    if args.num_warmup:
        # different prompts from the measured ones, so the prefix cache holds none of them
        warmup = build_workload(
            tokenizer, args.num_warmup, args.input_len, LengthRange(8, 8), args.seed + 10_000, with_text
        )
        results, _ = await run_requests(target, warmup, math.inf, 1.0, None, args.seed, "warm-up")
        failed = [r.error for r in results if not r.success]
        if failed:
            raise SystemExit(f"warm-up requests failed: {failed[0]}")

    runs = []
    for index, concurrency in enumerate(levels):
        # each level gets its own prompts (seed + index) so earlier levels do not warm the prefix cache for it
        requests = build_workload(
            tokenizer, args.num_prompts, args.input_len, args.output_len, args.seed + index, with_text
        )
        label = f"concurrency {concurrency}" if concurrency else "unbounded concurrency"
        results, duration = await run_requests(
            target, requests, args.request_rate, args.burstiness, concurrency, args.seed, label
        )
        summary = summarize_run(results, duration)
        print(summary_table(f"Serving benchmark: {label}", summary))
        runs.append(
            {
                "max_concurrency": concurrency,
                "summary": summary,
                "samples": latency_samples(results),
                "input_lens": [r.prompt_tokens for r in results],
                "output_lens": [r.output_tokens for r in results],
            }
        )

    plot_latency_cdfs([(f"c={run['max_concurrency']}", run["samples"]) for run in runs], folder / "latency_cdf.png")
    if len(levels) > 1:
        plot_sweep(levels, [run["summary"] for run in runs], folder / "sweep.png")
    return {"base_url": base_url, "endpoint": args.endpoint, "model": model, "config": args_as_json(args), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = make_results_dir(args.result_dir, args.name)
    if args.launch:
        server = launched_server(shlex.split(args.serve_args), folder / "server.log")
    else:
        server = nullcontext(args.base_url)
    with server as base_url:
        data = asyncio.run(benchmark(args, base_url, folder))
    save_json(folder, data)
    print(f"results in {folder}")
    return 0 if all(run["summary"]["failed"] == 0 for run in data["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
