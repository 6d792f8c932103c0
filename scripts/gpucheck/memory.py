"""(c) `--gpu-memory-utilization 0.9`: the KV blocks the start-up profile leaves room for, against the device
memory actually used under the worst-case steps.

The engine (SmolLM2-135M config, bf16, 256 sequences, 2048-token steps) gets 256 requests whose prompts fill whole
2048-token prefill steps, then decode 256 rows at once, every row sampling with top-k, top-p, min-p, the three
penalties, a logit bias and 20 logprobs, one request also asking for 20 prompt logprobs. Device memory in use is read
through NVML (no CUDA context in this process) every few milliseconds; it must stay under the device's total (no
OOM), and is reported against the 0.9 budget. A dry run runs the same engine on the CPU, where nothing is polled.
"""

from __future__ import annotations

import threading
import time

from gpucheck.common import CheckContext, SectionResult
from gpucheck.models import build_checkpoint

UTILIZATION = 0.9
POLL_INTERVAL_S = 0.005


class DeviceMemoryPoller:
    """Samples device 0's used bytes on a thread while active (NVML); `peak_bytes` None where NVML is missing."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self.total_bytes: int | None = None
        self.baseline_bytes: int | None = None  # in use before the engine started (the driver's own reservation)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DeviceMemoryPoller:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML (a CPU dry run): nothing to poll
            return self
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        self.total_bytes, self.baseline_bytes = int(info.total), int(info.used)
        self.peak_bytes = 0
        self._thread = threading.Thread(target=self._poll, args=(pynvml, handle), daemon=True)
        self._thread.start()
        return self

    def _poll(self, pynvml, handle) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes or 0, int(pynvml.nvmlDeviceGetMemoryInfo(handle).used))
            time.sleep(POLL_INTERVAL_S)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def worst_case_params(max_tokens: int) -> list:
    """(the first request's sampling, every other's): all sampler features on every row, prompt logprobs on one."""
    import msgspec

    from tokenmill.messages import SamplingParams

    every_sampler_feature = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={5: 2.0, 7: -2.0},
        logprobs=20,
        seed=0,
    )
    return [msgspec.structs.replace(every_sampler_feature, prompt_logprobs=20), every_sampler_feature]


def run(ctx: CheckContext) -> SectionResult:
    from tokenmill import LLM

    path = str(build_checkpoint("smollm2-135m", ctx.work_dir / "checkpoints", "bfloat16", ctx.dry_run))
    num_seqs, prompt_len, max_tokens = ctx.pick((256, 64, 16), (8, 16, 4))
    first, rest = worst_case_params(max_tokens)
    prompts = [[3 + (i * 7 + j) % 500 for j in range(prompt_len)] for i in range(num_seqs)]
    started = time.perf_counter()
    with DeviceMemoryPoller() as poller:
        with LLM(
            path,
            dtype="bfloat16",
            **ctx.engine_args(),
            gpu_memory_utilization=UTILIZATION,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=ctx.pick(2048, 64),
        ) as llm:
            info = llm.engine_info
            print(f"[memory] engine up after {time.perf_counter() - started:.1f} s", flush=True)
            ctx.save_partial({"num_kv_blocks": info.num_kv_blocks, "peak_used_bytes": poller.peak_bytes})
            results = llm.generate(prompts, [first] + [rest] * (num_seqs - 1), use_tqdm=False)
            print(f"[memory] generated after {time.perf_counter() - started:.1f} s", flush=True)
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    details = {
        "num_kv_blocks": info.num_kv_blocks,
        "block_size": info.block_size,
        "weight_bytes": info.weight_bytes,
        "peak_used_bytes": poller.peak_bytes,
        "total_bytes": poller.total_bytes,
        "generated_tokens": generated,
        "expected_tokens": num_seqs * max_tokens,
    }
    passed = generated == num_seqs * max_tokens
    summary = [
        f"profiled KV blocks: {info.num_kv_blocks} of {info.block_size} tokens "
        f"({info.num_kv_blocks * info.block_size} tokens); weights {info.weight_bytes / 2**20:.0f} MiB"
    ]
    if poller.peak_bytes is not None and poller.total_bytes and poller.baseline_bytes is not None:
        # NVML counts the driver's reservation as used (0.47 GiB on the H100 of 2026-11-27, the gap between its
        # total and CUDA's): the engine's share is what it added to that, against 0.9 of what CUDA reports
        engine_bytes = poller.peak_bytes - poller.baseline_bytes
        budget = UTILIZATION * (poller.total_bytes - poller.baseline_bytes)
        details.update(
            baseline_used_bytes=poller.baseline_bytes,
            engine_peak_bytes=engine_bytes,
            budget_bytes=budget,
            peak_over_budget=engine_bytes > budget,
        )
        passed = passed and poller.peak_bytes < poller.total_bytes
        summary.append(
            f"peak device memory used {poller.peak_bytes / 2**30:.2f} GiB of {poller.total_bytes / 2**30:.2f} GiB; "
            f"the engine's share {engine_bytes / 2**30:.2f} GiB ({poller.baseline_bytes / 2**30:.2f} GiB was in use "
            f"before it) against a budget of {budget / 2**30:.2f} GiB at {UTILIZATION}: "
            + (f"over by {(engine_bytes - budget) / 2**30:.2f} GiB" if engine_bytes > budget else "within it")
        )
    else:
        summary.append("device memory not polled (no NVML: a CPU dry run)")
    return SectionResult(passed, details, summary)
