"""Inter-token latency of running decodes while a long prompt arrives: chunked prefill vs one-step prefill.

For each mode a fresh `tokenmill serve` starts. After one unrelated warm-up request, N decode streams start (short
prompts, each generating --decode-tokens tokens with EOS ignored); once every stream has produced --tokens-before
tokens, one --long-prompt-len-token prompt is sent. The window is from that send until the long prompt's first token
(its whole prefill). Reported: p50/p90/p99/max of the decode streams' inter-token latencies (gaps between token
chunks, as vLLM's serving benchmark measures ITL) whose gap overlaps the window, the same before the long prompt
arrived (the baseline), and the long prompt's TTFT.

- chunked:   --max-num-batched-tokens --chunk-budget (e.g. 256): the prompt is prefilled a chunk per step, decodes
             keep running between chunks.
- unchunked: --no-enable-chunked-prefill with --max-num-batched-tokens = --max-model-len: the whole prompt is one step,
             and every decode stream waits for it.

    python scripts/bench_chunked_prefill.py [--num-streams 8] [--decode-tokens 256] [--long-prompt-len 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path

import numpy as np
from benchlib.launch import launched_server
from benchlib.results import args_as_json, make_results_dir, save_json
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
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-streams", type=int, default=8, help="decode streams running when the prompt arrives")
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=256, help="tokens each decode stream generates")
    parser.add_argument(
        "--tokens-before", type=int, default=8, help="send the long prompt once every stream has this many tokens"
    )
    parser.add_argument("--long-prompt-len", type=int, default=4000)
    parser.add_argument("--chunk-budget", type=int, default=256, help="--max-num-batched-tokens when chunked")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=4608,
        help="for both servers; the unchunked one uses it as its token budget",
    )
    parser.add_argument("--modes", default="chunked,unchunked", help="which of chunked,unchunked to run, in order")
    parser.add_argument(
        "--serve-args", default="--kv-cache-memory-bytes 1GiB", help="extra `tokenmill serve` flags for both servers"
    )
    parser.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the servers (torch threads); 1 avoids oversubscribing a shared CPU",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-root", type=Path, default=REPO_ROOT / "bench_results")
    return parser.parse_args(argv)


def mode_flags(mode: str, args: argparse.Namespace) -> list[str]:
    if mode == "chunked":
        return ["--enable-chunked-prefill", "--max-num-batched-tokens", str(args.chunk_budget)]
    if mode == "unchunked":
        return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(args.max_model_len)]
    raise ValueError(f"unknown mode {mode!r}")


async def run_scenario(
    url: str, args: argparse.Namespace, rng: np.random.Generator, desc: str
) -> tuple[list[StreamTiming], StreamTiming]:
    """Start the decode streams, send the long prompt once they are all decoding, wait for everything to end."""
    async with http_session() as session:
        model = await served_model_name(session, url)
        await stream_completion(session, url, completion_payload(model, random_token_ids(rng, 16), 2), "warm-up")
        streams = [StreamTiming(f"decode {i}", 0.0) for i in range(args.num_streams)]
        tasks = [
            asyncio.create_task(
                stream_completion(
                    session,
                    url,
                    completion_payload(model, random_token_ids(rng, args.decode_prompt_len), args.decode_tokens),
                    timing=timing,
                )
            )
            for timing in streams
        ]
        long_payload = completion_payload(model, random_token_ids(rng, args.long_prompt_len), 1)
        long_task = None
        with tqdm(total=args.num_streams * args.decode_tokens, desc=desc, unit="tok") as progress:
            while not all(task.done() for task in tasks):
                progress.update(sum(s.num_tokens for s in streams) - progress.n)
                if long_task is None and all(s.num_tokens >= args.tokens_before for s in streams):
                    long_task = asyncio.create_task(stream_completion(session, url, long_payload, "long prompt"))
                    progress.write(f"{desc}: long prompt sent")
                await asyncio.sleep(0.05)
            progress.update(sum(s.num_tokens for s in streams) - progress.n)
        await asyncio.gather(*tasks)
        if long_task is None:
            failed = [f"{s.label}: {s.error}" for s in streams if s.error]
            raise RuntimeError(failed[0] if failed else "the decode streams ended before all reached --tokens-before")
        return streams, await long_task


def measure_mode(mode: str, args: argparse.Namespace, results_dir: Path) -> dict:
    serve_args = ["--max-model-len", str(args.max_model_len), *shlex.split(args.serve_args), *mode_flags(mode, args)]
    print(f"[{mode}] tokenmill serve {shlex.join(serve_args)}", file=sys.stderr)
    rng = np.random.default_rng(args.seed)  # the same prompts in every mode
    with launched_server(serve_args, results_dir / f"server-{mode}.log") as url:
        streams, long_prompt = asyncio.run(run_scenario(url, args, rng, mode))
    errors = [f"{t.label}: {t.error}" for t in [*streams, long_prompt] if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    window_start, window_end = long_prompt.sent_at, long_prompt.chunk_times[0]
    in_window, before = split_gaps_at_window(streams, window_start, window_end)
    if not in_window:
        raise RuntimeError("no decode-stream gap overlaps the long prompt's prefill; raise --decode-tokens")
    streams_ended_early = sum(1 for s in streams if s.chunk_times[-1] < window_end)
    window_ms = summarize(in_window, scale=1000.0) | {"max": 1000.0 * max(in_window)}
    return {
        "serve_args": serve_args,
        "itl_in_window_ms": window_ms,
        "itl_before_ms": summarize(before, scale=1000.0),
        "long_prompt_ttft_s": long_prompt.ttft,
        "window_s": window_end - window_start,
        "decode_streams_ended_inside_window": streams_ended_early,
        "multi_token_chunks": sum(1 for s in streams for n in s.chunk_num_tokens if n > 1),
        "itl_in_window_s": in_window,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.server_threads)  # inherited by the server processes
    results_dir = make_results_dir(args.results_root, "chunked-prefill")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    per_mode = {mode: measure_mode(mode, args, results_dir) for mode in modes}
    results: dict = {"benchmark": "chunked-prefill", "params": args_as_json(args), "modes": per_mode}
    if "chunked" in per_mode and "unchunked" in per_mode:
        chunked, unchunked = per_mode["chunked"]["itl_in_window_ms"], per_mode["unchunked"]["itl_in_window_ms"]
        results["p99_itl_ratio_unchunked_over_chunked"] = unchunked["p99"] / chunked["p99"]
    path = save_json(results_dir, results)

    print(
        f"\n{args.num_streams} decode streams x {args.decode_tokens} tokens; a {args.long_prompt_len}-token prompt "
        f"arrives after {args.tokens_before} tokens each"
    )
    print(
        f"{'mode':<10} {'ITL p50':>9} {'p90':>9} {'p99':>9} {'max':>9} {'n':>5} {'baseline p50':>13} {'long TTFT':>10}"
    )
    for mode, r in per_mode.items():
        w, b = r["itl_in_window_ms"], r["itl_before_ms"]
        print(
            f"{mode:<10} {w['median']:>7.0f}ms {w['p90']:>7.0f}ms {w['p99']:>7.0f}ms {w['max']:>7.0f}ms "
            f"{w['count']:>5} {b['median']:>11.0f}ms {r['long_prompt_ttft_s']:>9.1f}s"
        )
        if r["decode_streams_ended_inside_window"]:
            print(
                f"  warning: {r['decode_streams_ended_inside_window']} decode streams ended before the long "
                f"prompt's first token; raise --decode-tokens"
            )
    if "p99_itl_ratio_unchunked_over_chunked" in results:
        print(
            f"p99 ITL while the long prompt is prefilled: {results['p99_itl_ratio_unchunked_over_chunked']:.1f}x "
            f"lower chunked"
        )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
