"""The GPU path in one run on one GPU: decode attention bandwidth against the GPU's peak, and end-to-end offline
throughput of `LLM.generate` (Triton kernels, CUDA graphs) against transformers `generate` on the default model.

1. Decode attention: `scripts/bench_kernels.py`'s decode benchmark (paged_attention_decode over a paged bf16
   cache), reported as achieved GB/s and as a fraction of the GPU's peak HBM bandwidth.
2. tokenmill: --num-prompts random prompts (ignore_eos, greedy) through one `LLM.generate` call with
   --max-num-seqs running at once; with --also-eager a second engine with `enforce_eager=True` shows what the
   decode CUDA graphs are worth.
3. transformers: the same requests, same weights and dtype, in static left-padded batches of --max-num-seqs,
   counting only each request's own max_tokens as useful output.

On a machine without CUDA it says so and exits 0.

    python scripts/bench_gpu.py [--num-prompts 256 --input-len 64:512 --output-len 64:256 --max-num-seqs 64]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import asdict

import bench_kernels
import torch
from benchlib.hf_baseline import load_hf_model, run_static_batches
from benchlib.results import args_as_json, make_results_dir, save_json
from benchlib.stats import format_table
from benchlib.workload import BenchRequest, LengthRange, build_workload, load_tokenizer


def decode_attention(args: argparse.Namespace) -> list[bench_kernels.Result]:
    """bench_kernels' decode benchmark at the requested batch sizes and context length."""
    kernel_args = bench_kernels.parse_args(
        [
            "--dtype",
            "bf16",
            "--context-len",
            str(args.context_len),
            "--batch-sizes",
            ",".join(str(b) for b in args.attention_batch_sizes),
        ]
    )
    peak = bench_kernels.peak_tbps(torch.cuda.get_device_name())
    return bench_kernels.bench_decode(kernel_args, torch.bfloat16, peak)


def run_engine(args: argparse.Namespace, requests: list[BenchRequest], enforce_eager: bool) -> dict:
    """One engine: a warm-up, then one timed `generate` over every request."""
    from tokenmill import LLM, SamplingParams

    engine_args = dict(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device="cuda",
    )
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in requests]
    with LLM(args.model, **engine_args) as llm:
        llm.generate([r.prompt_ids for r in requests[:8]], params[:8], use_tqdm=False)  # warm-up
        started = time.perf_counter()
        results = llm.generate([r.prompt_ids for r in requests], params)
        elapsed = time.perf_counter() - started
        info = llm.engine_info
    generated = sum(len(result.outputs[0].token_ids) for result in results)
    wanted = sum(r.output_len for r in requests)
    if generated != wanted:
        raise RuntimeError(f"tokenmill generated {generated} tokens where {wanted} were asked for")
    return {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_throughput": generated / elapsed,
        "request_throughput": len(requests) / elapsed,
        "dtype": info.dtype,
        "num_kv_blocks": info.num_kv_blocks,
        "enforce_eager": enforce_eager,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help='as for `tokenmill serve` ("" = the default model)')
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=LengthRange.parse, default=LengthRange(64, 512))
    parser.add_argument("--output-len", type=LengthRange.parse, default=LengthRange(64, 256))
    parser.add_argument("--max-num-seqs", type=int, default=64, help="engine max batch = baseline batch size")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--also-eager", action="store_true", help="also time the engine with enforce_eager=True")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument(
        "--attention-batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128]
    )
    parser.add_argument("--context-len", type=int, default=2048, help="decode attention benchmark context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", default="bench_results")
    parser.add_argument("--name", default="gpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu needs a CUDA GPU: it measures the Triton kernels and CUDA graphs, which run only there.")
        return 0
    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.model_source import resolve_config

    device_name = torch.cuda.get_device_name()
    folder = make_results_dir(args.result_dir, args.name)
    print(f"device: {device_name}", file=sys.stderr)

    attention = decode_attention(args)
    bench_kernels.print_table(attention)
    torch.cuda.empty_cache()  # the engine's worker sizes its KV cache from what is free

    tokenizer = load_tokenizer(args.model)
    requests = build_workload(tokenizer, args.num_prompts, args.input_len, args.output_len, args.seed)
    engines = [run_engine(args, requests, enforce_eager=False)]
    if args.also_eager:
        engines.append(run_engine(args, requests, enforce_eager=True))

    baseline = None
    if not args.skip_baseline:
        config = resolve_config(EngineConfig(model=ModelConfig(model=args.model)))
        model = load_hf_model(config.model.path, config.model.gguf_file, getattr(torch, args.dtype)).cuda()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        baseline = run_static_batches(model, requests, args.max_num_seqs, pad_id)
        del model
        gc.collect()

    rows = [
        (
            f"decode attention {r.config} (GB/s, of peak):",
            f"{r.gbps:.0f}, {r.peak_fraction:.1%}" if r.peak_fraction else f"{r.gbps:.0f}",
        )
        for r in attention
    ]
    for engine in engines:
        label = "tokenmill eager" if engine["enforce_eager"] else "tokenmill (CUDA graphs)"
        rows.append((f"{label} output tokens/s:", f"{engine['output_throughput']:.0f}"))
    if baseline is not None:
        rows.append(("transformers static batches output tokens/s:", f"{baseline.output_throughput:.0f}"))
        speedup = engines[0]["output_throughput"] / baseline.output_throughput
        rows.append(("tokenmill / transformers:", f"{speedup:.2f}x"))
    print(format_table(f"GPU benchmark on {device_name}", rows))

    save_json(
        folder,
        {
            "device": device_name,
            "config": args_as_json(args),
            "decode_attention": [asdict(r) for r in attention],
            "engines": engines,
            "transformers": None
            if baseline is None
            else {**asdict(baseline), "output_throughput": baseline.output_throughput},
        },
    )
    print(f"results in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
