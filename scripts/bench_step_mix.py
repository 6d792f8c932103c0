"""What a decode step costs with each kind of neighbour beside one greedy request (issue 28's decoding kinds, as
scripts/bench_bystander.py sends them).

One greedy request decodes beside other requests of one kind at a time (greedy ones, temperature-1 ones, n = 2 with
--max-logit-bias biases and stop ids, one structured-output request with a 200-property schema), every request with a
64-token random prompt and --max-tokens outputs. Per mix: the median and p99 of the gaps between the engine's
outputs (`LLM.step_listener`: one per step), and the engine's own split of a step (`LLM.engine_stats`): the worker's
forward + sampling, the scheduler's structured-output mask filling, and the rest (scheduling, messages; hidden by
overlap scheduling except when a structured-output request makes the step synchronous). Mixes alternate round by
round, so all see the same machine.

    OMP_NUM_THREADS=1 python scripts/bench_step_mix.py --rounds 2
    OMP_NUM_THREADS=1 python scripts/bench_step_mix.py --mixes "1 greedy" "1 greedy + 1 structured"
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
from bench_bystander import big_schema, stop_and_bias_logit_bias

from tokenmill.llm import LLM
from tokenmill.messages import SamplingParams, StructuredOutputsParams

PROMPT_TOKENS = 64
SKIPPED_GAPS = 5  # the first and last gaps of a run: prefill and the end of requests


def mixes(max_tokens: int, num_biases: int, num_stop_ids: int) -> dict[str, list[SamplingParams]]:
    """Each mix's sampling params, the greedy request first."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def hot(**fields) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, **fields)

    stop_ids = list(range(1, num_stop_ids + 1))
    bias = {int(token_id): value for token_id, value in stop_and_bias_logit_bias(num_stop_ids, num_biases).items()}
    structured = StructuredOutputsParams(json=big_schema())
    return {
        "1 greedy": [greedy],
        "3 greedy": [greedy] * 3,
        "1 greedy + 1 at temperature 1": [greedy, hot()],
        "1 greedy + 2 at temperature 1": [greedy, hot(), hot()],
        "1 greedy + n=2 with biases and stop ids": [greedy, hot(n=2, logit_bias=bias, stop_token_ids=stop_ids)],
        "1 greedy + 1 structured": [greedy, hot(structured_outputs=structured)],
    }


def run_mix(llm: LLM, params: list[SamplingParams], prompt: Callable[[], list[int]]) -> dict[str, float]:
    stamps: list[float] = []
    llm.step_listener = lambda _: stamps.append(time.perf_counter())
    before = llm.engine_stats()
    llm.generate([prompt() for _ in params], params, use_tqdm=False)
    stats = llm.engine_stats().since(before)
    llm.step_listener = None
    gaps = np.diff(stamps)
    gaps = gaps[SKIPPED_GAPS:-SKIPPED_GAPS] if len(gaps) > 4 * SKIPPED_GAPS else gaps
    steps = max(stats.num_steps, 1)
    return {
        "gap_median_ms": float(np.median(gaps) * 1e3),
        "gap_p99_ms": float(np.percentile(gaps, 99) * 1e3),
        "model_ms": stats.model_time_s / steps * 1e3,
        "mask_ms": stats.grammar_mask_time_s / steps * 1e3,
        "rest_ms": (stats.step_time_s - stats.model_time_s) / steps * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model (default: the shipped SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-logit-bias", type=int, default=1024)
    parser.add_argument("--max-stop-token-ids", type=int, default=256)
    parser.add_argument("--mixes", nargs="+", default=None, help="which mixes (default: all)")
    parser.add_argument("--engine-args", default="{}", help="JSON of further LLM(...) arguments")
    args = parser.parse_args(argv)
    chosen = mixes(args.max_tokens, args.max_logit_bias, args.max_stop_token_ids)
    if args.mixes:
        chosen = {name: chosen[name] for name in args.mixes}
    engine_args = {"max_model_len": 1024, "max_num_batched_tokens": 256} | json.loads(args.engine_args)
    llm = LLM(args.model, **engine_args)
    rng = np.random.default_rng(0)
    vocab = len(llm.tokenizer)  # prompt ids the tokenizer knows (the model's vocabulary may be padded past it)

    def prompt() -> list[int]:
        return [int(t) for t in rng.integers(min(1000, vocab // 2), vocab, PROMPT_TOKENS)]

    print("| round | mix | gap median (ms) | gap p99 | worker (forward + sampling) | grammar mask | rest |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for round_index in range(args.rounds):
        for name, params in chosen.items():
            r = run_mix(llm, params, prompt)
            print(
                f"| {round_index + 1} | {name} | {r['gap_median_ms']:.2f} | {r['gap_p99_ms']:.2f} | "
                f"{r['model_ms']:.2f} | {r['mask_ms']:.3f} | {r['rest_ms']:.2f} |",
                flush=True,
            )
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
