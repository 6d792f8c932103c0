"""Where a decode step's time goes: the `Worker` at batch B, in this process, under torch.profiler.

It prefills B random prompts of --context-len tokens, times --steps decode steps (one token per request per step,
no scheduler or messaging), prints the profiler's top operators by self CPU time (the compiled CPU kernels as
`cpu_ops::*`), and, with --compare-transformers, times one transformers forward of the same batch over the same
context for reference. `TOKENMILL_CPU_KERNELS=0` profiles the plain torch path instead.

    python scripts/profile_decode.py --batch-size 32 --context-len 320 --threads 2 --compare-transformers

`--verify-tokens 1,2,4,8` instead times speculative-decoding verification steps: one request at --context-len cached
tokens, a forward (and logits) of T query tokens (1 + drafts) per step, median of --steps steps at each T, with the
share its attention calls took; on the CPU kernels backend, also with every multi-token sequence sent to the SDPA
prompt path (`max_kernel_query_len` 1, as before the kernel took short queries), alternating the two round by round.

    OMP_NUM_THREADS=1 python scripts/profile_decode.py --verify-tokens 1,2,4,8 --context-len 200 --steps 9
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from benchlib.stats import summarize

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.workers.attention import AttentionBackend
    from tokenmill.workers.worker import Worker


def build_runner(
    model: str,
    dtype: str,
    num_blocks: int,
    block_size: int,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[Worker, EngineConfig]:
    """A loaded `Worker` (the engine's in-process forward, sampler and KV cache) with `num_blocks` KV blocks."""
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
    from tokenmill.model_source import resolve_config
    from tokenmill.workers.worker import Worker

    config = resolve_config(
        EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, quantization=quantization),
            cache=CacheConfig(num_kv_blocks=num_blocks, block_size=block_size, kv_cache_dtype=kv_cache_dtype),
        )
    )
    runner = Worker(config)
    runner.load_model()
    runner.allocate_kv_cache(num_blocks)
    return runner, config


class DecodeDriver:
    """Prefills every prompt in one step, then runs one decode step (a token per request) per `step()` call."""

    def __init__(self, runner: Worker, prompts: list[list[int]], max_steps: int, block_size: int) -> None:
        from tokenmill.messages import NewRequestData, SamplingParams, StepPlan

        greedy = SamplingParams(max_tokens=max_steps + 1, temperature=0.0, ignore_eos=True)
        blocks_each = -(-(len(prompts[0]) + max_steps + 1) // block_size)
        new = [
            NewRequestData(
                f"r{i}",
                prompt,
                len(prompt),
                greedy,
                list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)),
                0,
                len(prompt),
            )
            for i, prompt in enumerate(prompts)
        ]
        self.runner = runner
        self.result = runner.execute(StepPlan(0, new, [], []))
        self.computed = len(prompts[0])
        self.step_id = 0

    def step(self) -> float:
        """Run one decode step; returns its wall time in seconds."""
        from tokenmill.messages import RunningRequestData, StepPlan

        self.step_id += 1
        running = [
            RunningRequestData(rid, [token], [], self.computed, 1)
            for rid, token in zip(self.result.request_ids, self.result.sampled_token_ids)
        ]
        started = time.perf_counter()
        self.result = self.runner.execute(StepPlan(self.step_id, [], running, []))
        elapsed = time.perf_counter() - started
        self.computed += 1
        return elapsed


def label_cpu_kernels() -> None:
    """Make the compiled CPU kernels (ctypes calls, which the profiler cannot see) show up as `cpu_ops::<name>`."""
    from tokenmill.workers import backends
    from tokenmill.workers.cpu_backend import CpuKernelBackend

    if not isinstance(backends.attention_backend("cpu"), CpuKernelBackend):
        return

    def labelled(name: str, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(f"cpu_ops::{name}"):
                return fn(*args, **kwargs)

        return call

    from tokenmill.workers import cpu_backend

    CpuKernelBackend.write_kv = staticmethod(labelled("write_kv", CpuKernelBackend.write_kv))
    cpu_backend.paged_attention_cpu = labelled("attend", cpu_backend.paged_attention_cpu)  # what forward calls
    from tokenmill.workers.quantization.gguf import GGUFWeight

    for attr in ("matmul", "lookup"):  # GGUF weights kept quantized: the kernels of kernels/gguf_ops.py
        setattr(GGUFWeight, attr, labelled(f"gguf_{attr}", getattr(GGUFWeight, attr)))
    kernels = backends.device_kernels("cpu")
    ops = dataclasses.replace(
        kernels.ops,
        **{name: labelled(name, getattr(kernels.ops, name)) for name in ("rms_norm", "rotary", "silu_and_mul")},
    )
    labelled_kernels = backends.DeviceKernels(kernels.attention, ops)
    backends.device_kernels = lambda device_type: labelled_kernels  # this script runs on the CPU only


def one_request_forward(
    runner: Worker, backend: AttentionBackend, blocks: np.ndarray, start: int, num_tokens: int
) -> None:
    """A forward and the logits of `num_tokens` random query tokens of one request at positions [start, start +
    num_tokens), its KV in `blocks` ([1, n] block ids; keep block 0, the runner's padding block, out)."""
    from tokenmill.workers.attention import build_attention_metadata

    end = start + num_tokens
    block_size = runner.block_size
    meta = build_attention_metadata(
        np.array([num_tokens]), np.array([end]), blocks[:, : -(-end // block_size)], block_size, runner.device, backend
    )
    ids = torch.randint(100, 20_000, (num_tokens,), device=runner.device)
    positions = torch.arange(start, end, device=runner.device)
    with torch.inference_mode():
        runner.model.compute_logits(runner.model(ids, positions, meta, runner.kv_caches))


def verification_step_times(
    runner: Worker, context_len: int, query_tokens: list[int], steps: int, rounds: int = 2
) -> dict[str, dict[int, tuple[float, float]]]:
    """{mode: {T: (median step ms, median attention ms)}} for forwards of T query tokens of one request after
    `context_len` cached ones (the request's later tokens overwrite the same slots step after step). Modes: on the
    CPU kernels backend "kernel" (as it is) and "sdpa" (multi-token sequences on the prompt path), else the backend's
    class name; the best of `rounds` alternating rounds is kept."""
    from tokenmill.workers.backends import attention_backend
    from tokenmill.workers.cpu_backend import CpuKernelBackend

    backend = attention_backend(runner.device.type)
    max_len = context_len + max(query_tokens)
    blocks = np.arange(1, 1 + -(-max_len // runner.block_size))[None, :]  # block 0 is the runner's padding block
    if blocks.shape[1] >= runner.kv_caches[0][0].shape[0]:
        raise ValueError(f"context {context_len} + {max(query_tokens)} tokens needs more KV blocks")
    attention_s = [0.0]
    attend = backend.forward  # a layer's attention with its KV write

    def timed_attend(*args, **kwargs):
        started = time.perf_counter()
        result = attend(*args, **kwargs)
        attention_s[0] += time.perf_counter() - started
        return result

    one_request_forward(runner, backend, blocks, 0, context_len)
    kernel_backend = backend if isinstance(backend, CpuKernelBackend) else None
    modes: dict[str, int | None] = {type(backend).__name__: None}
    if kernel_backend is not None:
        modes = {"kernel": kernel_backend.max_kernel_query_len, "sdpa": 1}
    limit = kernel_backend.max_kernel_query_len if kernel_backend is not None else None
    results: dict[str, dict[int, tuple[float, float]]] = {mode: {} for mode in modes}
    backend.forward = timed_attend
    try:
        for _ in range(rounds):
            for mode, mode_limit in modes.items():
                if kernel_backend is not None and mode_limit is not None:
                    kernel_backend.max_kernel_query_len = mode_limit
                for num_tokens in query_tokens:
                    step_s, attn_s = [], []
                    for _ in range(steps):
                        attention_s[0] = 0.0
                        started = time.perf_counter()
                        one_request_forward(runner, backend, blocks, context_len, num_tokens)
                        step_s.append(time.perf_counter() - started)
                        attn_s.append(attention_s[0])
                    figures = (float(np.median(step_s)) * 1e3, float(np.median(attn_s)) * 1e3)
                    best = results[mode].get(num_tokens)
                    results[mode][num_tokens] = figures if best is None or figures[0] < best[0] else best
    finally:
        if kernel_backend is not None and limit is not None:
            kernel_backend.max_kernel_query_len = limit
        del backend.forward  # back to the class's
    return results


def transformers_step_time(config: EngineConfig, batch_size: int, context_len: int, repeats: int = 3) -> float:
    """Best time of one transformers decode forward at the same batch and context (DynamicCache, no padding)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    kwargs = {"gguf_file": config.model.gguf_file} if config.model.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32, **kwargs).eval()
    ids = torch.randint(100, 1000, (batch_size, context_len))
    best = float("inf")
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
        for _ in range(repeats):
            started = time.perf_counter()
            model(ids[:, -1:], past_key_values=cache, use_cache=True)
            best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", default=None, help="as `tokenmill serve` (default: the checkpoint's)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context-len", type=int, default=320)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--compare-transformers", action="store_true")
    parser.add_argument(
        "--verify-tokens",
        default=None,
        help="comma-separated query tokens per step (e.g. 1,2,4,8): time verification steps instead",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    block_size = 16
    if args.verify_tokens:
        query_tokens = [int(t) for t in args.verify_tokens.split(",")]
        num_blocks = 2 + -(-(args.context_len + max(query_tokens)) // block_size)
        runner, _ = build_runner(args.model, args.dtype, num_blocks, block_size, args.quantization)
        results = verification_step_times(runner, args.context_len, query_tokens, args.steps)
        print(
            f"one request at context {args.context_len}, {torch.get_num_threads()} threads: median step "
            f"(ratio to T={query_tokens[0]}) and its attention"
        )
        for mode, figures in results.items():
            base = figures[query_tokens[0]][0]
            cells = [
                f"T={t}: {step:.1f} ms ({step / base:.2f}x), attention {attn:.2f} ms"
                for t, (step, attn) in figures.items()
            ]
            print(f"{mode}: " + " | ".join(cells))
        return
    blocks_each = -(-(args.context_len + 2 * args.steps + 1) // block_size)
    runner, config = build_runner(
        args.model, args.dtype, 1 + args.batch_size * blocks_each, block_size, args.quantization
    )
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 20_000, args.context_len)] for _ in range(args.batch_size)]

    driver = DecodeDriver(runner, prompts, 2 * args.steps, block_size)
    step_ms = summarize([driver.step() for _ in range(args.steps)], 1e3)  # timed without the profiler
    label_cpu_kernels()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            driver.step()
    print(
        f"decode step at batch {args.batch_size}, context {args.context_len}, {torch.get_num_threads()} threads: "
        f"median {step_ms['median']:.1f} ms, mean {step_ms['mean']:.1f} ms"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.compare_transformers:
        hf = transformers_step_time(config, args.batch_size, args.context_len)
        print(f"transformers decode forward, same batch and context: {hf * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
