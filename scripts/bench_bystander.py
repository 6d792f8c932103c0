"""A bystander's inter-token gaps while the worst request the server's limits admit runs, one kind at a time.

A bystander streams a short greedy completion. Once it has --idle-tokens tokens (its idle gaps), one hostile request
is sent, the worst of its kind that the limits admit (issue 28):

- cache_salt: the longest salt (--max-cache-salt-bytes) on a prompt of the whole context, n = --max-n choices
- prompt_logprobs: k = --max-logprobs over the longest prompt the budget admits (--max-prompt-logprobs-elements)
- structured_outputs: a JSON schema of many properties, each with a long description, near the body limit
- stop_and_bias: --max-stop-token-ids stop ids and --max-logit-bias biases (the stop ids biased away, so it runs its
  max_tokens), n = --max-n choices
- plain: a request of the same shape as cache_salt without the salt (the cost of the work itself, for comparison)

The window runs from the hostile request's send to its answer; the bystander's gaps that overlap it are compared with
its idle gaps (p50, p99, max) and reported as a ratio (up to the bystander's end, when the hostile request
outlasts it: `outlived_bystander`). The bystander is idle before the window and again after it: the baseline is
whichever of the two idle windows has the lower p99 (both are reported), so a stall that lands in one idle window
cannot inflate the baseline and flatter the ratio. Every kind runs against one server, in turn, each with a fresh
bystander. The limits given here must be the server's (they are passed to a launched server).

Those idle windows are at other context lengths than the window: the one before it covers the bystander's first
--idle-tokens tokens, and a decode step's attention grows with the context (float32 K/V: at 1,000 tokens the default
model reads ~46 MB of cache per step, half its weights' bytes). So each kind also streams the same bystander alone,
--control-runs times, before its hostile run (`control_gaps`): the idle gap at each token position, the smallest over
those runs (a stall in one cannot raise it). The window's gaps are then compared with the idle gaps at the same
positions (`same_positions`: "ctl p99", "p99/ctl" in the table), the work the bystander's steps do apart from the
hostile request being the same.

    python scripts/bench_bystander.py                      # launches `tokenmill serve` on the default model
    python scripts/bench_bystander.py --serve-args "/path/to/tiny --dtype float32" --max-model-len 1024
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
from collections.abc import Callable
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

KINDS = ("plain", "cache_salt", "prompt_logprobs", "structured_outputs", "stop_and_bias")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (its limits given below); default: launch")
    parser.add_argument(
        "--serve-args", default="", help="`tokenmill serve` flags when launching (the limits below are added)"
    )
    parser.add_argument("--kinds", default=",".join(KINDS), help="which hostile requests, comma-separated")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-n", type=int, default=8)
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--max-cache-salt-bytes", type=int, default=256)
    parser.add_argument("--max-prompt-logprobs-elements", type=int, default=1 << 15)
    parser.add_argument("--max-stop-token-ids", type=int, default=256)
    parser.add_argument("--max-logit-bias", type=int, default=1024)
    parser.add_argument("--idle-tokens", type=int, default=24, help="bystander tokens before the hostile request")
    parser.add_argument("--bystander-tokens", type=int, default=400, help="the bystander's max_tokens")
    parser.add_argument(
        "--control-runs", type=int, default=2, help="runs of the bystander alone per kind (the per-position baseline)"
    )
    parser.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of a launched server (torch threads; 1 on a shared machine)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench_bystander-server.log")
    return parser.parse_args(argv)


def limit_flags(args: argparse.Namespace) -> list[str]:
    """The limits as `tokenmill serve` flags."""
    names = (
        "max_model_len",
        "max_num_batched_tokens",
        "max_n",
        "max_logprobs",
        "max_cache_salt_bytes",
        "max_prompt_logprobs_elements",
        "max_stop_token_ids",
        "max_logit_bias",
    )
    return [part for name in names for part in ("--" + name.replace("_", "-"), str(getattr(args, name)))]


# The decoding kinds' max_tokens: long enough that the bystander's p99 during the window is a percentile of the
# hostile request's steady state (at 32 tokens the window held ~10 gaps, and its p99 was the max: the prefill step).
# More tokens only make the request heavier: it is still the worst the limits admit.
HOSTILE_DECODE_TOKENS = 256


def hostile_body(kind: str, model: str, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    """The worst `/v1/completions` body of `kind` the limits admit (non-streamed)."""
    whole_context = random_token_ids(rng, args.max_model_len - 2)
    if kind in ("plain", "cache_salt"):
        body = {"prompt": whole_context, "n": args.max_n, "max_tokens": 1}
        if kind == "cache_salt":
            body["cache_salt"] = "s" * args.max_cache_salt_bytes
    elif kind == "prompt_logprobs":
        num_prompt = min(args.max_model_len - 2, args.max_prompt_logprobs_elements // (args.max_logprobs + 1))
        body = {"prompt": whole_context[:num_prompt], "prompt_logprobs": args.max_logprobs, "max_tokens": 1}
    elif kind == "structured_outputs":
        body = {
            "prompt": whole_context[:64],
            "max_tokens": HOSTILE_DECODE_TOKENS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": big_schema()}},
        }
    elif kind == "stop_and_bias":
        body = {
            "prompt": whole_context[:64],
            "n": args.max_n,
            "max_tokens": HOSTILE_DECODE_TOKENS,
            "ignore_eos": True,
            "stop_token_ids": list(range(1, args.max_stop_token_ids + 1)),
            "logit_bias": stop_and_bias_logit_bias(args.max_stop_token_ids, args.max_logit_bias),
        }
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return {"model": model, "temperature": 1.0, **body}


def big_schema() -> dict:
    """The structured kind's schema: 200 string properties with long descriptions, 20 of them required."""
    properties = {f"field_{i}": {"type": "string", "maxLength": 8, "description": "d" * 10_000} for i in range(200)}
    return {"type": "object", "properties": properties, "required": list(properties)[:20]}


def stop_and_bias_logit_bias(num_stop_ids: int, num_entries: int) -> dict[str, float]:
    """`num_entries` biases: -100 on the stop ids 1..`num_stop_ids` (no choice stops early, so every token is checked
    against every stop id and the request runs its max_tokens: the worst case), +0.5 on ids from 1000 on."""
    bias = {str(token_id): -100.0 for token_id in range(1, min(num_stop_ids, num_entries) + 1)}
    return bias | {str(1000 + i): 0.5 for i in range(num_entries - len(bias))}


async def send_hostile(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str]:
    async with session.post(url + "/v1/completions", json=body) as response:
        return response.status, (await response.text())[:200]


def gaps_by_position(timing: StreamTiming) -> list[tuple[int, float, float]]:
    """Each gap between token chunks as (the token count at its end, its start, its end)."""
    positions = np.cumsum(timing.chunk_num_tokens)
    return [(int(positions[i + 1]), start, end) for i, (start, end) in enumerate(timing.itl_intervals())]


async def control_gaps(session: aiohttp.ClientSession, url: str, payload: dict, runs: int) -> dict[int, float]:
    """The bystander streamed alone `runs` times: each token position's gap in seconds, the smallest over the runs."""
    best: dict[int, float] = {}
    for run in range(runs):
        timing = await stream_completion(session, url, payload, f"control-{run}")
        if timing.error:
            raise RuntimeError(f"the control bystander failed: {timing.error}")
        for position, start, end in gaps_by_position(timing):
            best[position] = min(best.get(position, float("inf")), end - start)
    return best


def same_positions(bystander: StreamTiming, start: float, end: float, control: dict[int, float]) -> dict | None:
    """The window's gaps and the idle gaps at the same token positions (those both runs have), in ms."""
    pairs = [
        (gap_end - gap_start, control[position])
        for position, gap_start, gap_end in gaps_by_position(bystander)
        if gap_end > start and gap_start < end and position in control
    ]
    if not pairs:
        return None
    during, idle = zip(*pairs, strict=True)
    return {"during_ms": gap_summary(list(during)), "idle_ms": gap_summary(list(idle))}


async def one_kind(
    session: aiohttp.ClientSession, url: str, model: str, body: dict, args: argparse.Namespace, rng: np.random.Generator
) -> dict:
    """The bystander's gaps before and during one hostile request, and alone at the same positions."""
    payload = completion_payload(model, random_token_ids(rng, 16), args.bystander_tokens)
    control = await control_gaps(session, url, payload, args.control_runs) if args.control_runs > 0 else {}
    bystander = StreamTiming("bystander", 0.0)
    task = asyncio.create_task(stream_completion(session, url, payload, timing=bystander))
    while bystander.num_tokens < args.idle_tokens:
        if task.done():
            raise RuntimeError(f"the bystander ended early: {bystander.error}")
        await asyncio.sleep(0.005)
    start = time.perf_counter()
    status, answer = await send_hostile(session, url, body)
    end = time.perf_counter()
    await task
    if bystander.error:
        raise RuntimeError(bystander.error)
    # a prefill held to short chunks beside the bystander can outlast it: its gaps then count up to its end
    outlived = bystander.chunk_times[-1] < end
    during, before = split_gaps_at_window([bystander], start, min(end, bystander.chunk_times[-1]))
    before = before[1:]  # the first gap can hold the bystander's own admission
    after = [gap_end - gap_start for gap_start, gap_end in bystander.itl_intervals() if gap_start >= end]
    idle_windows = {"before": gap_summary(before), "after": gap_summary(after) if len(after) >= MIN_IDLE_GAPS else None}
    return {
        "status": status,
        "answer": answer if status != 200 else "",
        "window_s": end - start,
        "outlived_bystander": outlived,
        "idle_ms": strict_idle(idle_windows),
        "idle_windows_ms": idle_windows,
        "during_ms": gap_summary(during),
        "same_positions": same_positions(bystander, start, min(end, bystander.chunk_times[-1]), control),
    }


# the fewest gaps an idle window after the hostile request needs to count as a baseline (the bystander may end soon
# after it)
MIN_IDLE_GAPS = 20


def gap_summary(gaps: list[float]) -> dict[str, float]:
    """The gaps' statistics in ms, their max and their mean per token."""
    return summarize(gaps, 1000.0) | {"max": 1000.0 * max(gaps), "per_token": 1000.0 * mean_gap(gaps)}


def strict_idle(windows: dict[str, dict[str, float] | None]) -> dict[str, float]:
    """The idle baseline: of the windows before and after the hostile request, the one with the lower p99. A stall
    that lands in one idle window (another process on a shared core) would otherwise raise the baseline and flatter
    the ratio; taking the quieter window can only make the comparison stricter."""
    measured = [window for window in windows.values() if window is not None]
    return min(measured, key=lambda window: window["p99"])


def mean_gap(gaps: list[float]) -> float:
    """Seconds per token over consecutive gaps: robust to chunks that arrive in bursts (a zero gap after a long one),
    which make the median gap meaningless."""
    return sum(gaps) / len(gaps)


async def run(url: str, args: argparse.Namespace, kinds: list[str]) -> dict[str, dict]:
    rng = np.random.default_rng(args.seed)
    results: dict[str, dict] = {}
    async with http_session() as session:
        model = await served_model_name(session, url)
        await stream_completion(session, url, completion_payload(model, random_token_ids(rng, 16), 4), "warm-up")
        for kind in kinds:
            results[kind] = await one_kind(session, url, model, hostile_body(kind, model, args, rng), args, rng)
    return results


def report(results: dict[str, dict], print_line: Callable[[str], None] = print) -> None:
    """One line per kind: the bystander's gaps (ms) idle and during the hostile request, and their ratios."""
    print_line(
        f"{'kind':<20}{'status':>7}{'window s':>10}{'idle mean':>10}{'idle p99':>10}{'during mean':>12}"
        f"{'during p99':>12}{'max':>9}{'mean ratio':>11}{'p99 ratio':>11}{'ctl p99':>9}{'p99/ctl':>9}"
    )
    for kind, r in results.items():
        idle, during, matched = r["idle_ms"], r["during_ms"], r.get("same_positions")
        control = "" if matched is None else f"{matched['idle_ms']['p99']:>9.1f}"
        control += "" if matched is None else f"{matched['during_ms']['p99'] / matched['idle_ms']['p99']:>9.2f}"
        print_line(
            f"{kind:<20}{r['status']:>7}{r['window_s']:>10.2f}{idle['per_token']:>10.1f}{idle['p99']:>10.1f}"
            f"{during['per_token']:>12.1f}{during['p99']:>12.1f}{during['max']:>9.1f}"
            f"{during['per_token'] / idle['per_token']:>11.2f}{during['p99'] / idle['p99']:>11.2f}{control}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = [kind for kind in args.kinds.split(",") if kind]
    serve_args = shlex.split(args.serve_args) + limit_flags(args)
    os.environ["OMP_NUM_THREADS"] = str(args.server_threads)  # inherited by a launched server's processes
    launch = nullcontext(args.base_url) if args.base_url else launched_server(serve_args, args.log)
    with launch as url:
        results = asyncio.run(run(url, args, kinds))
    report(results)
    print(json.dumps(results))
    failed = [kind for kind, r in results.items() if r["status"] != 200]
    if failed:
        print(f"not admitted: {', '.join(failed)} (the limits given must be the server's)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
