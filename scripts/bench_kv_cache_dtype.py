"""FP8 KV cache against the model's dtype on the CPU, in this process on the `Worker`: accuracy and
decode speed, for each `--kv-cache-dtype` given.

1. Accuracy: a fixed English text (--kl-tokens tokens) teacher-forced through the paged cache: a --prefill-tokens
   prompt, then one token per step, so the decode path reads what earlier steps stored. At every position after the
   prompt, the next-token distribution is compared with the "auto" cache's: mean KL(auto || fp8) in nats, the largest
   one, and how often the two argmaxes agree.
2. Speed: decode steps of --batch-size sequences with --context-len cached tokens each (model forward + logits, as
   `profile_decode.py` times them but without its prefill: the caches are filled with random keys and values, since
   what attention costs does not depend on them); median step time -> decode tokens/s.

    python scripts/bench_kv_cache_dtype.py --kv-cache-dtypes auto fp8 fp8_e5m2 --batch-size 32 --context-len 1024
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec
import numpy as np
import torch

TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only people who saw it "
    "up close were the keeper and the men who brought his supplies. Every evening he climbed the ninety-six steps to "
    "the lamp room, trimmed the wick, polished the great lens until it shone, and wrote the state of the weather in a "
    "leather-bound log. Ships passing in the night never knew his name, but they steered by his light, and in the "
    "worst storms of winter that light was the difference between a safe harbour and the rocks. When the keeper's "
    "daughter was old enough, she began to help him. She learned to read the barometer, to tell a squall from a gale "
    "by the colour of the sky, and to count the seconds between the flashes of the other lights along the coast. "
    "Years later, when the lamp was replaced by an automatic beacon and the keeper's cottage stood empty, she would "
    "still wake at dusk, listening for the sound of the wind, and remember the weight of the brass oil can in her "
    "hands. Scientists who study coastal erosion now use the old logs to reconstruct a century of weather: the "
    "careful handwriting records wind direction, wave height, visibility and temperature, four times a day, without "
    "a single gap. In this way the quiet routine of one family became a scientific record that no satellite could "
    "replace, and the lighthouse, long after its last keeper left, still helps people find their way."
)


def build_runner(kv_cache_dtype: str, num_blocks: int):
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from tokenmill.model_source import resolve_config
    from tokenmill.workers.worker import Worker

    config = resolve_config(
        EngineConfig(
            model=ModelConfig(model="", dtype="float32"),
            cache=CacheConfig(num_kv_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype),
            parallel=ParallelConfig(device="cpu"),
        )
    )
    runner = Worker(config)
    runner.load_model()
    return runner


def with_kv_cache_dtype(runner, name: str) -> None:
    """Point the runner at another KV cache dtype (its next `allocate_kv_cache` uses it); the weights stay."""
    cache = msgspec.structs.replace(runner.config.cache, kv_cache_dtype=name)
    runner.config = msgspec.structs.replace(runner.config, cache=cache)


def forward(runner, input_ids, query_lens, seq_lens, block_tables) -> torch.Tensor:
    """Logits of every sequence's last query token, through the runner's model and current KV cache."""
    from tokenmill.workers.attention import build_attention_metadata, token_positions
    from tokenmill.workers.backends import attention_backend

    meta = build_attention_metadata(
        query_lens,
        seq_lens,
        block_tables,
        runner.block_size,
        runner.device,
        attention_backend("cpu"),
        runner.decode_chunk_tokens(),
    )
    positions = torch.from_numpy(token_positions(query_lens, seq_lens))
    hidden = runner.model(input_ids, positions, meta, runner.kv_caches)
    last_rows = torch.from_numpy(np.cumsum(query_lens) - 1)
    return runner.model.compute_logits(hidden[last_rows])


@torch.inference_mode()
def teacher_forced_log_probs(runner, ids: list[int], prefill: int) -> torch.Tensor:
    """`[len(ids) - prefill, V]` float64 log-probabilities of each next token after the prompt."""
    num_blocks = -(-len(ids) // runner.block_size) + 1
    runner.allocate_kv_cache(num_blocks)
    runner.kv_cache.zero_never_used(list(range(num_blocks)))
    table = np.arange(1, num_blocks)[None, :]
    rows = [forward(runner, torch.tensor(ids[:prefill]), np.array([prefill]), np.array([prefill]), table)]
    for position in range(prefill, len(ids) - 1):
        rows.append(forward(runner, torch.tensor([ids[position]]), np.array([1]), np.array([position + 1]), table))
    return torch.cat(rows).double().log_softmax(-1)


@torch.inference_mode()
def decode_step_seconds(runner, names: list[str], batch_size: int, context_len: int, steps: int) -> dict[str, float]:
    """Median time of one decode step of `batch_size` sequences over `context_len` cached tokens (random K/V), per
    KV cache dtype; the dtypes take turns step by step, so that a busy machine slows them alike."""
    blocks_each = -(-(context_len + 1) // runner.block_size)
    generator = torch.Generator().manual_seed(0)
    caches = {}
    for name in names:
        with_kv_cache_dtype(runner, name)
        runner.allocate_kv_cache(1 + batch_size * blocks_each)
        for k_cache, v_cache in runner.kv_caches:
            for cache in (k_cache, v_cache):
                cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
        caches[name] = runner.kv_cache  # the Worker's PagedKVCache: `runner.kv_caches` reads its layers
    tables = 1 + np.arange(batch_size * blocks_each).reshape(batch_size, blocks_each)
    input_ids = torch.randint(100, 20_000, (batch_size,), generator=generator)
    query_lens, seq_lens = np.ones(batch_size, dtype=np.int64), np.full(batch_size, context_len + 1)
    times = {name: [] for name in names}
    for _ in range(steps + 1):  # the first round warms up
        for name in names:
            runner.kv_cache = caches[name]
            started = time.perf_counter()
            forward(runner, input_ids, query_lens, seq_lens, tables)
            times[name].append(time.perf_counter() - started)
    runner.kv_cache = None
    return {name: float(np.median(t[1:])) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8", "fp8_e5m2"])
    parser.add_argument("--kl-tokens", type=int, default=288)
    parser.add_argument("--prefill-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill.kernels import cpu_ops
    from tokenmill.workers.backends import cpu_kernels_enabled

    runner = build_runner("auto", 1)
    tokenizer_path = runner.config.model.tokenizer or runner.config.model.path
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": runner.config.model.gguf_file} if runner.config.model.gguf_file else {}
    ids = AutoTokenizer.from_pretrained(tokenizer_path, **kwargs)(TEXT)["input_ids"]
    if len(ids) < args.kl_tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --kl-tokens {args.kl_tokens}")
    ids = ids[: args.kl_tokens]
    path = "compiled CPU kernels" if cpu_kernels_enabled() and cpu_ops.library() else "torch"
    print(f"{runner.architecture} float32 on {torch.get_num_threads()} threads, attention via {path}", flush=True)

    figures = {}
    reference = None
    steps = decode_step_seconds(runner, args.kv_cache_dtypes, args.batch_size, args.context_len, args.steps)
    for name in args.kv_cache_dtypes:
        with_kv_cache_dtype(runner, name)
        log_probs = teacher_forced_log_probs(runner, ids, args.prefill_tokens)
        step = steps[name]
        row = {
            "kv_cache_dtype": name,
            "kv_block_bytes": runner.kv_block_bytes(),
            "decode_step_ms": step * 1e3,
            "decode_tokens_per_s": args.batch_size / step,
        }
        if reference is None:
            reference = log_probs
        else:
            kl = (reference.exp() * (reference - log_probs)).sum(-1)
            row.update(
                mean_kl=float(kl.mean()),
                max_kl=float(kl.max()),
                top1_agreement=float((reference.argmax(-1) == log_probs.argmax(-1)).double().mean()),
            )
        figures[name] = row
        print(json.dumps(row), flush=True)
    base = figures[args.kv_cache_dtypes[0]]["decode_tokens_per_s"]
    for name, row in figures.items():
        print(
            f"{name:>9}: block {row['kv_block_bytes']} B, decode {row['decode_tokens_per_s']:.1f} tok/s "
            f"({row['decode_tokens_per_s'] / base:.2f}x) at batch {args.batch_size}, context {args.context_len}"
            + (
                f"; KL {row['mean_kl']:.2e} mean / {row['max_kl']:.2e} max over {len(ids) - args.prefill_tokens} "
                f"positions, top-1 agrees {row['top1_agreement']:.1%}"
                if "mean_kl" in row
                else ""
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "figures": figures}, f, indent=1)


if __name__ == "__main__":
    main()
