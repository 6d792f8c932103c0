"""Structured-output overhead: output tokens/s with every request under a JSON schema vs the same workload
unconstrained, at one batch size, in one run, with the grammar engine's per-step mask time.

1. Constrained: N chat prompts, each under one of a few agent-style JSON schemas (`response_format` json_schema),
   sampled at temperature 1 with a seed per request, --max-num-seqs at once. Each request's output length is kept.
2. Unconstrained: the same prompts and seeds with `max_tokens` = `min_tokens` = that request's constrained length
   (ignore_eos), so both runs generate exactly the same number of tokens per request at the same batch sizes.
3. --repeats pairs of (constrained, unconstrained) runs, alternating, after a discarded first constrained run (it
   finds the lengths; the same seeds then give the same tokens), so drift of a shared machine hits both kinds alike.

The ratio is total unconstrained time / total constrained time (= constrained tokens/s over unconstrained tokens/s);
each pair's own ratio is shown too. The mask time is the scheduler's time computing the batch's bitmasks
(`grammar_mask_time_s` in the engine's stats), per step and as a share of step time.

    python scripts/bench_structured_outputs.py --num-prompts 96 --max-num-seqs 32 --repeats 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchlib.results import args_as_json, make_results_dir, save_json

TARGET_RATIO = 0.9

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "email": {"type": "string", "pattern": r"^[a-z]{1,10}@[a-z]{1,10}\.com$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        },
        "required": ["name", "email", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "forecast": {
                "type": "array",
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                        "high": {"type": "integer", "minimum": -50, "maximum": 60},
                        "low": {"type": "integer", "minimum": -50, "maximum": 60},
                    },
                    "required": ["day", "high", "low"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["city", "unit", "forecast"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "priority": {"enum": ["low", "medium", "high"]},
            "done": {"type": "boolean"},
            "estimate_hours": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 100}, {"type": "null"}]},
            "steps": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 4},
        },
        "required": ["title", "priority", "done", "steps"],
        "additionalProperties": False,
    },
]
TASKS = [
    "Describe a new customer as JSON.",
    "Give the weather forecast for a city as JSON.",
    "Write a to-do item for repairing a bicycle as JSON.",
]


def run(llm, prompts: list[list[int]], params: list) -> dict:
    before = llm.engine_stats()
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    stats = llm.engine_stats().since(before)
    lengths = [len(r.outputs[0].token_ids) for r in results]
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(lengths),
        "output_throughput": sum(lengths) / elapsed,
        "num_steps": stats.num_steps,
        "mean_step_time_ms": 1e3 * stats.step_time_s / max(1, stats.num_steps),
        "mask_time_per_step_ms": 1e3 * stats.grammar_mask_time_s / max(1, stats.num_steps),
        "mask_share_of_step_time": stats.grammar_mask_time_s / stats.step_time_s if stats.step_time_s else 0.0,
        "lengths": lengths,
        "texts": [r.outputs[0].text for r in results],
        "finish_reasons": [r.outputs[0].finish_reason for r in results],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help='as for `tokenmill serve` ("" = the default model)')
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="(constrained, unconstrained) pairs to time")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the engine's worker")
    parser.add_argument("--result-dir", default="bench_results")
    parser.add_argument("--name", default="structured_outputs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from tokenmill import LLM, SamplingParams, StructuredOutputsParams

    args = parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    folder = make_results_dir(args.result_dir, args.name)
    with LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": TASKS[i % len(TASKS)]}], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
            for i in range(args.num_prompts)
        ]
        constrained = [
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=args.max_tokens,
                structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]),
            )
            for i in range(args.num_prompts)
        ]
        llm.generate(prompts[:4], constrained[:4], use_tqdm=False)  # warm-up: kernels, grammar compiles
        first = run(llm, prompts, constrained)
        invalid = [i for i, text in enumerate(first["texts"]) if not _is_json(text)]
        plain = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=n, min_tokens=n, ignore_eos=True)
            for i, n in enumerate(first["lengths"])
        ]
        pairs = [(run(llm, prompts, constrained), run(llm, prompts, plain)) for _ in range(args.repeats)]

    print(f"{'run':<18}{'tokens':>8}{'tok/s':>9}{'steps':>7}{'step ms':>9}{'mask ms/step':>14}{'mask share':>12}")
    for i, pair in enumerate(pairs, 1):
        for name, r in zip(("constrained", "unconstrained"), pair):
            print(
                f"{name + ' ' + str(i):<18}{r['output_tokens']:>8}{r['output_throughput']:>9.1f}{r['num_steps']:>7}"
                f"{r['mean_step_time_ms']:>9.1f}{r['mask_time_per_step_ms']:>14.3f}"
                f"{r['mask_share_of_step_time']:>11.2%}"
            )
    pair_ratios = [plain_run["elapsed_s"] / constrained_run["elapsed_s"] for constrained_run, plain_run in pairs]
    ratio = sum(p["elapsed_s"] for _, p in pairs) / sum(c["elapsed_s"] for c, _ in pairs)
    print(
        f"constrained / unconstrained tokens/s: {ratio:.3f} (pairs: {', '.join(f'{r:.3f}' for r in pair_ratios)}); "
        f"target >= {TARGET_RATIO}: {'met' if ratio >= TARGET_RATIO else 'MISSED'}"
    )
    print(
        f"outputs that are not valid JSON: {len(invalid)} of {args.num_prompts}; finish reasons: "
        f"{ {r: first['finish_reasons'].count(r) for r in set(first['finish_reasons'])} }"
    )
    for r in (first, *(r for pair in pairs for r in pair)):
        r.pop("texts")
    save_json(
        folder,
        {
            "config": args_as_json(args),
            "first_constrained": first,
            "pairs": [{"constrained": c, "unconstrained": u} for c, u in pairs],
            "ratio": ratio,
            "pair_ratios": pair_ratios,
            "invalid_json": invalid,
            "target": {"value": ratio, "target": TARGET_RATIO, "met": ratio >= TARGET_RATIO},
        },
    )
    print(f"results in {folder}")
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
