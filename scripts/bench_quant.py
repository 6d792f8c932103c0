"""GGUF weights kept quantized vs dequantized at load, on the CPU: decode speed, memory and accuracy, in one run.

Default mode: for 1 and 2 threads, each configuration (the default model's Q4_1/Q8_0 weights kept quantized with
float32 activations; dequantized at load to bfloat16 and to float32) runs in a fresh subprocess, so its resident
memory (RSS) is its own. Each times decode steps at batch 1 and batch 32 (`Worker` driven directly, as
scripts/profile_decode.py does, no scheduler), and measures the memory bandwidth with a large read at the same thread
count, to give batch 1's fraction of the bandwidth bound: weight bytes read per token / step time / bandwidth.

`--kl`: the mean KL divergence of the next-token distributions, quantized vs the dequantized float32 reference,
over the first --kl-tokens tokens of the repository's documentation (README.md, then docs/*.md).

    python scripts/bench_quant.py
    python scripts/bench_quant.py --kl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from profile_decode import DecodeDriver

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {  # name -> (--quantization, --dtype)
    "gguf-q4_1 f32": ("gguf", "float32"),
    "gguf-q4_1 f32 float-act": ("gguf", "float32"),
    "dequant bf16": ("none", "bfloat16"),
    "dequant f32": ("none", "float32"),
}
# the GGUF kernels' activation mode per quantized configuration (kernels/gguf_ops.py)
GGUF_ACTIVATIONS = {"gguf-q4_1 f32": "int8", "gguf-q4_1 f32 float-act": "float"}
BLOCK_SIZE = 16


def build_runner(quantization: str, dtype: str, num_blocks: int, memory: dict | None = None):
    """A runner of the default model; `memory` gets the RSS before and after loading the weights."""
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from tokenmill.model_source import resolve_config
    from tokenmill.workers.worker import Worker

    config = resolve_config(
        EngineConfig(
            model=ModelConfig(quantization=quantization, dtype=dtype),
            cache=CacheConfig(num_kv_blocks=num_blocks, block_size=BLOCK_SIZE),
            parallel=ParallelConfig(device="cpu"),
        )
    )
    runner = Worker(config)
    memory = {} if memory is None else memory
    memory["rss_before_load"] = rss_bytes()
    runner.load_model()
    memory["rss_loaded"] = rss_bytes()
    runner.allocate_kv_cache(num_blocks)
    return runner


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of the best of `repeats` sums over a `gib` GiB float32 tensor (a large streaming read)."""
    data = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def decode_tokens_per_s(runner, batch: int, context: int, steps: int) -> float:
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 20_000, context)] for _ in range(batch)]
    driver = DecodeDriver(runner, prompts, steps + 2, BLOCK_SIZE)
    driver.step()  # warm-up
    times = [driver.step() for _ in range(steps)]
    from tokenmill.messages import StepPlan

    runner.execute(StepPlan(driver.step_id + 1, [], [], list(driver.result.request_ids)))  # forget the requests
    return batch / float(np.median(times))


def measure(name: str, threads: int, context: int, steps: int) -> dict:
    """One configuration in this (fresh) process."""
    torch.set_num_threads(threads)
    quantization, dtype = CONFIGS[name]
    if name in GGUF_ACTIVATIONS:
        from tokenmill.kernels import gguf_ops

        gguf_ops.DEFAULT_ACTIVATIONS = GGUF_ACTIVATIONS[name]
    batches = (1, 32)
    blocks_each = -(-(context + steps + 4) // BLOCK_SIZE)
    memory: dict = {}
    runner = build_runner(quantization, dtype, 1 + max(batches) * blocks_each, memory)
    speeds = {f"batch{b}": decode_tokens_per_s(runner, b, context, steps) for b in batches}
    rss = rss_bytes()
    bandwidth = memory_bandwidth()
    kv_bytes = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
    return {
        "name": name,
        "threads": threads,
        **speeds,
        "rss": rss,
        **memory,
        "kv_bytes": kv_bytes,
        "weight_bytes": runner.weight_bytes,
        "bandwidth": bandwidth,
        "bandwidth_fraction": runner.weight_bytes * speeds["batch1"] / bandwidth,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| threads | configuration | decode tok/s batch 1 | decode tok/s batch 32 | weights MiB | RSS MiB "
        "(loading added) | KV cache MiB | batch-1 share of bandwidth bound | measured bandwidth GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mib = 2**20
        lines.append(
            f"| {r['threads']} | {r['name']} | {r['batch1']:.1f} | {r['batch32']:.1f} "
            f"| {r['weight_bytes'] / mib:.0f} | {r['rss'] / mib:.0f} "
            f"({(r['rss_loaded'] - r['rss_before_load']) / mib:+.0f}) | {r['kv_bytes'] / mib:.0f} "
            f"| {100 * r['bandwidth_fraction']:.0f}% | {r['bandwidth'] / 1e9:.1f} |"
        )
    return "\n".join(lines)


def ratios(results: list[dict]) -> str:
    lines = []
    for threads in sorted({r["threads"] for r in results}):
        by_name = {r["name"]: r for r in results if r["threads"] == threads}
        quant = by_name.get("gguf-q4_1 f32")
        for ref in ("dequant bf16", "dequant f32"):
            if quant and ref in by_name:
                other = by_name[ref]
                lines.append(
                    f"{threads} thread(s): quantized / {ref}: batch 1 x{quant['batch1'] / other['batch1']:.2f}, "
                    f"batch 32 x{quant['batch32'] / other['batch32']:.2f}, RSS x{quant['rss'] / other['rss']:.2f}"
                )
        float_act = by_name.get("gguf-q4_1 f32 float-act")
        if quant and float_act:
            lines.append(
                f"{threads} thread(s): float activations / int8 activations: "
                f"batch 1 x{float_act['batch1'] / quant['batch1']:.2f}, "
                f"batch 32 x{float_act['batch32'] / quant['batch32']:.2f}"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------- KL divergence


def chunked_logits(model, input_ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """float32 logits of every position, the sequence run through a fresh paged cache `chunk` tokens at a time."""
    from tokenmill.workers.attention import build_attention_metadata
    from tokenmill.workers.backends import attention_backend

    num_blocks = -(-len(input_ids) // BLOCK_SIZE)
    shape = model.kv_cache_shape(num_blocks, BLOCK_SIZE)
    dtype = next(iter(model.model.norm.parameters())).dtype
    kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(model.num_layers)]
    blocks = np.arange(num_blocks)[None, :]
    logits = []
    for start in range(0, len(input_ids), chunk):
        end = min(start + chunk, len(input_ids))
        meta = build_attention_metadata(
            np.array([end - start]),
            np.array([end]),
            blocks[:, : -(-end // BLOCK_SIZE)],
            BLOCK_SIZE,
            torch.device("cpu"),
            attention_backend("cpu"),
        )
        with torch.inference_mode():
            logits.append(model.compute_logits(model(input_ids[start:end], torch.arange(start, end), meta, kv_caches)))
    return torch.cat(logits)


def kl_divergence(num_tokens: int, chunk: int = 256) -> dict:
    from transformers import AutoTokenizer

    text = "\n\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    reference = build_runner("none", "float32", 1)
    tokenizer = AutoTokenizer.from_pretrained(reference.config.model.path, gguf_file=reference.config.model.gguf_file)
    ids = torch.tensor(tokenizer(text)["input_ids"][:num_tokens])
    if len(ids) < num_tokens:
        raise SystemExit(f"the documentation has only {len(ids)} tokens")
    log_p = chunked_logits(reference.model, ids, chunk).log_softmax(-1)
    del reference
    quantized = build_runner("gguf", "float32", 1)
    log_q = chunked_logits(quantized.model, ids, chunk).log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agree = (log_p.argmax(-1) == log_q.argmax(-1)).float().mean()
    return {
        "tokens": num_tokens,
        "mean_kl": kl.mean().item(),
        "p99_kl": kl.quantile(0.99).item(),
        "max_kl": kl.max().item(),
        "top1_agreement": agree.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--context-len", type=int, default=64, help="prompt tokens before the timed decode steps")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of every configuration, in alternating order; each figure is the best round's "
        "(the machine is shared and noisy)",
    )
    parser.add_argument("--kl", action="store_true", help="measure the KL divergence instead of the speed")
    parser.add_argument("--kl-tokens", type=int, default=2000)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "<config>|<threads>": a worker subprocess
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    if args.kl:
        torch.set_num_threads(max(args.threads))
        result = kl_divergence(args.kl_tokens)
        print(
            f"quantized vs dequantized float32 over {result['tokens']} tokens: mean KL {result['mean_kl']:.5f} "
            f"(p99 {result['p99_kl']:.4f}, max {result['max_kl']:.4f}), top-1 agreement "
            f"{100 * result['top1_agreement']:.1f}%"
        )
        results = [result]
    elif args.one:
        name, threads = args.one.rsplit("|", 1)
        print(json.dumps(measure(name, int(threads), args.context_len, args.steps)))
        return
    else:
        runs: dict[tuple[str, int], list[dict]] = {}
        for round_index in range(args.rounds):
            for threads in args.threads:
                for name in args.configs[:: 1 if round_index % 2 == 0 else -1]:
                    done = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--one",
                            f"{name}|{threads}",
                            "--context-len",
                            str(args.context_len),
                            "--steps",
                            str(args.steps),
                        ],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    run = json.loads(done.stdout.strip().splitlines()[-1])
                    runs.setdefault((name, threads), []).append(run)
                    print(
                        f"round {round_index + 1}: {name}, {threads} thread(s): {run['batch1']:.1f} / "
                        f"{run['batch32']:.1f} tok/s",
                        file=sys.stderr,
                    )
        results = []
        for found in runs.values():
            best = dict(min(found, key=lambda r: r["rss"]))
            best.update(
                batch1=max(r["batch1"] for r in found),
                batch32=max(r["batch32"] for r in found),
                bandwidth=max(r["bandwidth"] for r in found),
            )
            best["bandwidth_fraction"] = best["weight_bytes"] * best["batch1"] / best["bandwidth"]
            results.append(best)
        results.sort(key=lambda r: (r["threads"], args.configs.index(r["name"])))
        print(table(results))
        print(ratios(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
