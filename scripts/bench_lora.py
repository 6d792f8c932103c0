"""Multi-LoRA throughput: a batch of 32 requests spread over 4 adapters (rank 16, every projection) against the same
batch on the base model alone, output tokens/s of each and their ratio, measured in one run on one engine (runs
interleaved, best of `--repeats`, so a busy machine slows both alike).

    python scripts/bench_lora.py [--model PATH] [--num-requests 32 --num-adapters 4 --rank 16 --max-tokens 64]
                                 [--lora-dtype auto|bfloat16|float16]   # the slots' dtype (vLLM's --lora-dtype)
    python scripts/bench_lora.py --kernels   # the CPU paths on each LoRA layer: the native kernel (kernels/lora_cpu.py)
                                             # and the torch paths of workers/lora/punica.py

The adapters are random (A and B), written in PEFT's layout into a temporary folder from the model's shapes. The
default model is the shipped SmolLM2-135M (its GGUF weights, kept quantized).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJECTIONS = {  # PEFT name -> (module path, input size key, output size key)
    "q_proj": ("self_attn", "hidden", "q"),
    "k_proj": ("self_attn", "hidden", "kv"),
    "v_proj": ("self_attn", "hidden", "kv"),
    "o_proj": ("self_attn", "q", "hidden"),
    "gate_proj": ("mlp", "hidden", "inter"),
    "up_proj": ("mlp", "hidden", "inter"),
    "down_proj": ("mlp", "inter", "hidden"),
}


def write_random_adapter(folder: Path, sizes: dict[str, int], num_layers: int, rank: int, seed: int) -> None:
    """A rank-`rank` PEFT adapter on every projection, A and B random (scale 2 = alpha / r)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for name, (parent, size_in, size_out) in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, sizes[size_in], generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(sizes[size_out], rank, generator=generator) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def model_sizes(config) -> dict[str, int]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "hidden": config.hidden_size,
        "q": config.num_attention_heads * head_dim,
        "kv": config.num_key_value_heads * head_dim,
        "inter": config.intermediate_size,
    }


def run_end_to_end(args: argparse.Namespace) -> dict:
    from tokenmill import LLM, LoRARequest, SamplingParams

    llm = LLM(
        args.model or "",
        enable_lora=True,
        max_loras=args.num_adapters,
        max_lora_rank=args.rank,
        max_num_seqs=args.num_requests,
        max_model_len=512,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        lora_dtype=args.lora_dtype,
    )
    from tokenmill.workers.model_loader import load_hf_config

    hf_config = load_hf_config(llm.config.model)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapters = []
    for index in range(args.num_adapters):
        folder = root / f"adapter-{index}"
        write_random_adapter(folder, model_sizes(hf_config), hf_config.num_hidden_layers, args.rank, seed=index)
        adapters.append(LoRARequest(f"adapter-{index}", index + 1, str(folder)))
    prompts = [f"Request {i}: tell me a story about the number {i}." for i in range(args.num_requests)]
    loras = [adapters[i % len(adapters)] for i in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)  # warm up, adapters into their slots
    best = {"base": 0.0, "lora": 0.0}
    for _ in range(args.repeats):
        for mode in best:
            started = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False, lora_request=loras if mode == "lora" else None)
            tokens = sum(len(result.outputs[0].token_ids) for result in results)
            best[mode] = max(best[mode], tokens / (time.perf_counter() - started))
    llm.shutdown()
    return {
        "num_requests": args.num_requests,
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "lora_dtype": args.lora_dtype,
        "max_tokens": args.max_tokens,
        "base_tokens_per_s": round(best["base"], 1),
        "lora_tokens_per_s": round(best["lora"], 1),
        "ratio": round(best["lora"] / best["base"], 3),
        "load_average": os.getloadavg(),
    }


def time_layer_paths(
    tokens: int, a: torch.Tensor, bt: torch.Tensor, widths: list[int], repeats: int
) -> dict[str, float]:
    """Best-of milliseconds of each CPU path (and of the base layer's packed matmul they ride on) for `tokens` rows
    spread evenly over the slots, the paths interleaved."""
    from tokenmill.kernels import lora_cpu
    from tokenmill.workers.lora.punica import (
        LoRAStep,
        add_lora_gathered,
        add_lora_grouped,
        add_lora_masked,
        add_lora_packed,
    )
    from tokenmill.workers.models.packed_linear import linear, packed

    slots, _, in_features = a.shape
    weight = torch.randn(bt.shape[2], in_features) * 0.02
    x, out = torch.randn(tokens, in_features), torch.zeros(tokens, bt.shape[2])
    token_slots = torch.arange(tokens) % slots
    step = LoRAStep(slots)
    step.set(token_slots, torch.float32)
    one_hot = step.one_hot
    assert one_hot is not None
    flat = slots * a.shape[1]
    a_packed, b_packed = packed(a.view(flat, -1)), packed(bt.view(flat, -1).t().contiguous())
    weight_packed = packed(weight)
    groups, bt_slices, rows = step.groups, b_slices(bt, widths), step.rows
    assert groups is not None and rows is not None, "the native LoRA kernel did not build"
    columns = [piece.first_column for piece in bt_slices] + [bt.shape[2]]
    kernel_weights = lora_cpu.LoRAWeights.of(a, columns, a.shape[1] // len(widths))
    kernel_weights.write_b([piece.bt for piece in bt_slices])
    paths = {
        "native": lambda: lora_cpu.lora_add(x, out, kernel_weights, rows),
        "grouped": lambda: add_lora_grouped(x, out, a, bt_slices, groups),
        "packed": lambda: add_lora_packed(x, out, a_packed, b_packed, step),
        "masked": lambda: add_lora_masked(x, out, a, bt, one_hot),
        "gathered": lambda: add_lora_gathered(x, out, a, bt, token_slots),
        "base_matmul_packed": lambda: linear(x, weight_packed),
    }
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, run in paths.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - started) * 1e3)
    return {name: round(ms, 4) for name, ms in best.items()}


# SmolLM2-135M's LoRA layers: input size and each fused slice's output columns
LAYERS = {"qkv": (576, [576, 192, 192]), "o": (576, [576]), "gate_up": (576, [1536, 1536]), "down": (1536, [576])}


def b_slices(bt: torch.Tensor, widths: list[int]) -> list:
    """A fused layer's slices of B, each its own ranks and output columns (what the grouped path reads)."""
    from tokenmill.workers.lora.punica import BSlice

    rank, first, pieces = bt.shape[1] // len(widths), 0, []
    for index, width in enumerate(widths):
        block = bt[:, index * rank : (index + 1) * rank, first : first + width].contiguous()
        pieces.append(BSlice(block, index * rank, first))
        first += width
    return pieces


def time_decode_step(num_slots: int, rank: int, tokens: int, num_layers: int, repeats: int) -> dict[str, float]:
    """The native kernel over every LoRA layer of a `num_layers`-layer SmolLM2-135M, each layer its own slot weights
    (as a decode step reads them: from memory, not from cache) and the activations shared: best-of milliseconds and
    the slot weights' bytes per second."""
    from tokenmill.kernels import lora_cpu

    rows = lora_cpu.SlotRows.of(torch.arange(tokens) % num_slots, num_slots)
    buffers = {
        name: (torch.randn(tokens, size), torch.zeros(tokens, sum(widths))) for name, (size, widths) in LAYERS.items()
    }
    calls = []
    for _ in range(num_layers):
        for name, (in_features, widths) in LAYERS.items():
            columns = [0, *itertools.accumulate(widths)]
            a = torch.randn(num_slots, len(widths) * rank, in_features) * 0.02
            weights = lora_cpu.LoRAWeights.of(a, columns, rank)
            weights.write_b([torch.randn(num_slots, rank, width) * 0.02 for width in widths])
            calls.append((weights, *buffers[name]))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for weights, x, out in calls:
            lora_cpu.lora_add(x, out, weights, rows)
        best = min(best, time.perf_counter() - started)
    weight_bytes = sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w, _, _ in calls)
    return {
        "ms": round(best * 1e3, 3),
        "slot_weights_MB": round(weight_bytes / 1e6, 1),
        "GB_per_s": round(weight_bytes / best / 1e9, 1),
    }


def run_kernels(args: argparse.Namespace) -> dict:
    """Each LoRA layer of SmolLM2-135M with `--num-adapters` slots: the CPU paths side by side; then the native
    kernel over a whole decode step's layers."""
    timings = {}
    for name, (in_features, widths) in LAYERS.items():
        slots, ranks = args.num_adapters, len(widths) * args.rank
        a, bt = torch.randn(slots, ranks, in_features) * 0.02, torch.randn(slots, ranks, sum(widths)) * 0.02
        for tokens in (32, 512):
            paths = time_layer_paths(tokens, a, bt, widths, args.repeats * 10)
            timings[f"{name} {in_features} -> {sum(widths)}, {tokens} tokens, ms"] = paths
    step = time_decode_step(args.num_adapters, args.rank, args.num_requests, 30, args.repeats * 10)
    timings[f"decode step, native, 30 layers, {args.num_requests} tokens"] = step
    threads = f"{args.num_adapters} slots, rank {args.rank}, {torch.get_num_threads()} threads"
    return {"layers": threads, **timings, "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model path (default: the shipped SmolLM2-135M)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--lora-dtype", default="auto", choices=["auto", "float16", "bfloat16"], help="slots' dtype")
    parser.add_argument("--kernels", action="store_true", help="time the CPU LoRA paths on each layer instead")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for --kernels (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        result = run_kernels(args) if args.kernels else run_end_to_end(args)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
