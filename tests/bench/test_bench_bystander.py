"""Issue 28's acceptance on a real server (tiny random checkpoint): the worst request of each kind that the limits
admit does not stall a streaming bystander (scripts/bench_bystander.py does the measuring).

The bystander's seconds per token during the hostile request must stay within 2x of its idle figure, plus the noise
measured on it while idle (its p99 gap, at least 5 ms), since this machine is shared. A long-prompt kind (cache_salt
over the whole context) is compared with the same request without the hostile field: the prompt's own prefill is
ordinary work that chunked prefill spreads over steps; what must not add anything is the salt. Timing on a shared
machine is noisy, so a kind gets up to three measurements (a stall such as a salt hashed into every block fails all).
The prompt-logprobs kind is held to the idle figure: each prompt position it scores is charged its LM head in the
step's budget, so its steps stay as short as a decode step's on this LM-head-bound model.
"""

from __future__ import annotations

import asyncio

import bench_bystander
import pytest
from benchlib.launch import launched_server

pytestmark = pytest.mark.slow

ATTEMPTS = 3


def within(during_s: float, reference_s: float, noise_s: float) -> bool:
    return during_s <= 2.0 * reference_s + max(noise_s, 0.005)


def kind_holds(results: dict[str, dict], kind: str) -> bool:
    result = results[kind]
    assert result["status"] == 200, result  # the worst admitted request is admitted
    idle, during = result["idle_ms"], result["during_ms"]
    if kind == "cache_salt":
        plain = results["plain"]["during_ms"]
        return within(during["per_token"] / 1000, plain["per_token"] / 1000, plain["p99"] / 1000)
    return within(during["per_token"] / 1000, idle["per_token"] / 1000, idle["p99"] / 1000)


def test_the_worst_admitted_requests_keep_a_bystander_within_2x(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server's torch threads: one, on a shared machine
    args = bench_bystander.parse_args(
        [
            "--max-n",
            "2",
            "--max-num-batched-tokens",
            "256",
            "--max-prompt-logprobs-elements",
            "16384",
            "--bystander-tokens",
            "800",
        ]
    )
    serve_args = [
        str(tiny_checkpoints("llama")),
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        "128MiB",
        *bench_bystander.limit_flags(args),
    ]
    pending = ["cache_salt", "prompt_logprobs", "structured_outputs", "stop_and_bias"]
    with launched_server(serve_args, tmp_path / "server.log") as url:
        for _ in range(ATTEMPTS):
            results = asyncio.run(bench_bystander.run(url, args, ["plain", *pending]))
            pending = [kind for kind in pending if not kind_holds(results, kind)]
            if not pending:
                break
    assert not pending, {kind: results[kind] for kind in pending}
