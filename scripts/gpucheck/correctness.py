"""(b) Greedy decoding through the offline `LLM` against transformers on the same device, weights and dtype.

Per dtype (float32, bfloat16) and CUDA graphs (on, off: `enforce_eager`), on a SmolLM2-135M-config checkpoint (a
tiny random-weight one in a dry run), with chunked prefill (a 64-token step budget, so prompts take several chunks)
and prefix caching on (the prompts share a prefix, and the batch runs twice, the second time from the cache). In
float32 every output must equal transformers' greedy tokens up to the reference's first near tie (top-2 logits within
1e-4); in bfloat16, whose logits tie at a far coarser grain, up to the first difference, where each side's token
must be among the other's top 5 (vLLM's check_logprobs_close; `tests/helpers/reference.py`).
"""

from __future__ import annotations

import numpy as np

from gpucheck.common import CheckContext, SectionResult
from gpucheck.models import build_checkpoint
from tests.helpers.reference import (
    CLOSE_TOP_K,
    assert_greedy_close,
    assert_greedy_match,
    hf_greedy_reference,
    hf_greedy_top_ids,
)

PREFIX_LEN = 40
STEP_TOKEN_BUDGET = 64  # max_num_batched_tokens: prompts longer than this are prefilled in chunks


def make_prompts(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 50 to 150 tokens (ids above the special ones), all opening with one shared prefix."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab_size, PREFIX_LEN).tolist()
    return [prefix + rng.integers(3, vocab_size, int(rng.integers(10, 110))).tolist() for _ in range(count)]


def compare(dtype: str, outputs: list[dict], references: list[list]) -> dict:
    """Tokens compared and the mismatches, per batch of outputs (float32: up to each first near tie; else the top-5
    rule at the first difference)."""
    compared, mismatches = 0, []
    for index, (ours, reference) in enumerate(zip(outputs, references, strict=True)):
        try:
            if dtype == "float32":
                compared += assert_greedy_match(ours["tokens"], reference)
            else:
                compared += assert_greedy_close(ours["tokens"], ours["top_ids"], reference)
        except AssertionError as mismatch:
            mismatches.append(f"prompt {index}: {str(mismatch)[:300]}")
    return {"tokens_compared": compared, "tokens_in_references": sum(map(len, references)), "mismatches": mismatches}


def run_engine(
    ctx: CheckContext, path: str, dtype: str, enforce_eager: bool, prompts: list[list[int]], max_tokens: int
) -> dict:
    """Two rounds of greedy generation in one engine: tokens per round and the prefix-cache hits of round two."""
    from tokenmill import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=CLOSE_TOP_K)
    with LLM(
        path,
        dtype=dtype,
        **ctx.engine_args(),
        enforce_eager=enforce_eager,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=STEP_TOKEN_BUDGET,
        max_num_seqs=8,
        max_model_len=512,
        gpu_memory_utilization=0.3,
    ) as llm:
        rounds = [llm.generate(prompts, greedy, use_tqdm=False) for _ in range(2)]
    return {
        "outputs": [
            [
                {
                    "tokens": list(r.outputs[0].token_ids),
                    "top_ids": [top_ids for _, top_ids, _ in r.outputs[0].logprobs or []],
                }
                for r in results
            ]
            for results in rounds
        ],
        "cached_tokens_round_two": sum(r.num_cached_tokens for r in rounds[1]),
    }


def hf_references(path: str, dtype: str, device: str, prompts: list[list[int]], max_tokens: int) -> list:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to's argument wrongly
    reference = hf_greedy_reference if dtype == "float32" else hf_greedy_top_ids
    references = [reference(model, prompt, max_tokens) for prompt in prompts]
    del model
    return references


def check_model(ctx: CheckContext, name: str, max_tokens: int, done: list[dict]) -> list[dict]:
    """Every (dtype, CUDA graphs) configuration of one model; `done` are earlier models' rows (for partials)."""
    path = str(build_checkpoint(name, ctx.work_dir / "checkpoints", "float32", ctx.dry_run))
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size, ctx.pick(6, 3))
    rows = []
    for dtype in ("float32", "bfloat16"):
        references = hf_references(path, dtype, ctx.device, prompts, max_tokens)
        for enforce_eager in ctx.pick((False, True), (True,)):
            row: dict = {"model": name, "dtype": dtype, "cuda_graphs": not enforce_eager}
            try:
                engine = run_engine(ctx, path, dtype, enforce_eager, prompts, max_tokens)
                rounds = [compare(dtype, outputs, references) for outputs in engine["outputs"]]
                row.update(
                    rounds=rounds,
                    cached_tokens_round_two=engine["cached_tokens_round_two"],
                    passed=all(not r["mismatches"] for r in rounds) and engine["cached_tokens_round_two"] > 0,
                )
            except Exception as error:  # one configuration's failure is recorded; the others still run
                row.update(passed=False, error=f"{type(error).__name__}: {error}"[:2000])
            rows.append(row)
            ctx.save_partial({"runs": done + rows})
    return rows


def run(ctx: CheckContext) -> SectionResult:
    max_tokens = ctx.pick(24, 6)
    rows: list[dict] = []
    for name in ctx.pick(("smollm2-135m",), ("tiny-llama",)):
        rows += check_model(ctx, name, max_tokens, rows)
    summary = [
        "| model | dtype | CUDA graphs | tokens compared (round 1, 2) | prefix-cache hits | result |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        compared = ", ".join(f"{r['tokens_compared']}/{r['tokens_in_references']}" for r in row.get("rounds", []))
        outcome = (
            "pass"
            if row["passed"]
            else row.get("error")
            or "; ".join(m for r in row.get("rounds", []) for m in r["mismatches"])[:300]
            or "no prefix-cache hits"
        )
        summary.append(
            f"| {row['model']} | {row['dtype']} | {row['cuda_graphs']} | {compared or '-'} | "
            f"{row.get('cached_tokens_round_two', '-')} | {outcome} |"
        )
    return SectionResult(all(row["passed"] for row in rows), {"max_tokens": max_tokens, "runs": rows}, summary)
