"""Peak resident memory of each tokenmill process for the largest prompt-logprobs request the budget admits.

Launches `tokenmill serve` with --max-prompt-logprobs-elements, warms it up with a plain request, records each
process's peak RSS (VmHWM in /proc), then sends one `/v1/completions` request with the longest prompt the budget
admits for k = --max-logprobs and n = --n (prompt tokens x (k + 1) x n at the budget), and records the peaks again.
The growth of each process's peak is what the request cost it (the worker's includes its LM-head chunks).

    python scripts/bench_prompt_logprobs_rss.py
    python scripts/bench_prompt_logprobs_rss.py --serve-args "/path/to/model" --budget 2000000 --max-model-len 8192
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
from benchlib.launch import launched_server
from benchlib.streaming import random_token_ids

MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-args", default="--kv-cache-memory-bytes 1GiB", help="`tokenmill serve` flags")
    parser.add_argument("--budget", type=int, default=1 << 23, help="--max-prompt-logprobs-elements")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--k", type=int, default=20, help="prompt_logprobs (and --max-logprobs)")
    parser.add_argument(
        "--n", type=int, default=0, help="choices; 0: as many as the budget admits with the whole context as the prompt"
    )
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench_prompt_logprobs_rss.log")
    return parser.parse_args(argv)


def server_pids(port: int) -> dict[str, int]:
    """The serving processes by name (frontend, scheduler, worker...), found from the one listening on `port`."""
    found: dict[str, int] = {}
    for status in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = status.read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "tokenmill.cli serve" in command and f"--port {port}" in command:
            found["frontend"] = int(status.parent.name)
    if "frontend" in found:
        for child in (
            (Path(f"/proc/{found['frontend']}/task") / str(found["frontend"]) / "children").read_text().split()
        ):
            comm = Path(f"/proc/{child}/comm").read_text().strip()
            found[f"{comm}-{child}"] = int(child)
    return found


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MIB
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    num_choices = args.n or max(1, args.budget // ((args.k + 1) * (args.max_model_len - 2)))
    num_prompt = min(args.max_model_len - 2, args.budget // ((args.k + 1) * num_choices))
    serve_args = shlex.split(args.serve_args) + [
        "--max-model-len",
        str(args.max_model_len),
        "--max-logprobs",
        str(args.k),
        "--max-n",
        str(num_choices),
        "--max-prompt-logprobs-elements",
        str(args.budget),
    ]
    with launched_server(serve_args, args.log) as url:
        port = int(url.rsplit(":", 1)[1])
        # warm-up: a constrained request, so the scheduler has loaded its grammar tokenizer, and a prompt-logprobs one
        for warm_up in ({"response_format": {"type": "json_object"}}, {"prompt_logprobs": 1}):
            requests.post(
                url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **warm_up}, timeout=600
            ).raise_for_status()
        pids = server_pids(port)
        before = {name: peak_rss_mib(pid) for name, pid in pids.items()}
        prompt = random_token_ids(np.random.default_rng(0), num_prompt)
        started = time.perf_counter()
        answer = requests.post(
            url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": args.k, "n": num_choices},
            timeout=3600,
        )
        elapsed = time.perf_counter() - started
        after = {name: peak_rss_mib(pid) for name, pid in pids.items()}
    answer.raise_for_status()
    elements = num_prompt * (args.k + 1) * num_choices
    print(
        f"request: {num_prompt} prompt tokens x (k {args.k} + 1) x n {num_choices} = {elements:,} elements "
        f"(budget {args.budget:,}); answered 200 in {elapsed:.1f} s, {len(answer.content) / MIB:.1f} MiB of JSON"
    )
    print(f"{'process':<16}{'peak RSS before MiB':>22}{'peak RSS after MiB':>21}{'growth MiB':>12}")
    for name in pids:
        print(f"{name:<16}{before[name]:>22.1f}{after[name]:>21.1f}{after[name] - before[name]:>12.1f}")
    print(json.dumps({"elements": elements, "before_mib": before, "after_mib": after, "seconds": elapsed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
