"""Where one batch-1 token's wall time goes, split across the engine's processes, in ms/token and percent.

Three measurements, each mode (`eager`: every kernel called from the model's Python, as before recorded steps;
`recorded`: the decoder's kernel calls replayed, `workers/cpu_graphs.py`; in one native loop where the platform allows,
which times each call itself) alternating round by round so that both
see the same machine:

1. The worker in this process (`Worker.execute` at batch 1, one request at --context-len): the step's wall time, the
   time inside the GGUF matmul kernels (`tm_gguf_matmul*`, LM head included), inside the other compiled kernels
   (attention, KV write, RMSNorm, rotary, SiLU-and-mul), and the rest: the worker's Python and small torch ops.
2. The engine (`LLM`: scheduler and worker processes, one request of --context-len prompt tokens, greedy): the
   scheduler's wall time per decode step (`SchedulerStats.step_time_s`) and the part the worker reported
   (`model_time_s`: forward and sampling), from the difference of a 1-token and a (1 + --tokens)-token run, and the
   interval between the client's StepOutputs arrivals.
3. In this process: the scheduler's own `schedule()` + `update()` for one decoding request, and the frontend's
   incremental detokenization of one token plus its SSE chunk.

4. The messages between two real processes (`benchlib/message_hops.py`): the plan → worker → result round trip and
   the outputs → frontend one (medians).

The worker's plan apply is in its Python row. The engine's own figures (2.) are printed below the table as a check:
they are means of wall times, which a loaded machine inflates; the table's rows are medians, and the worker's rows
use the calling thread's CPU time unless `--clock wall`.

    OMP_NUM_THREADS=1 python scripts/profile_token.py --rounds 3
    OMP_NUM_THREADS=1 python scripts/profile_token.py --rounds 3 --kv-cache-dtype float16
    OMP_NUM_THREADS=1 python scripts/profile_token.py \
        --model ~/.cache/tokenmill/llama.cpp/models/qwen2.5-0.5b-random-Q8_0.gguf
"""

from __future__ import annotations

import os

# The in-process worker's KV caches and large tensors on huge pages, as in the engine's children (tokenmill/launcher.py;
# torch reads this once, at its first large allocation), so that its figures are the engine's.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from benchlib.message_hops import message_round_trips_ms
from profile_decode import DecodeDriver, build_runner

MODES = ("eager", "recorded")
# What the worker's figures are measured on: wall time, or (default) the calling thread's CPU time, which on a shared
# machine leaves out the time the process waited for a core (with one compute thread all the work is on this one).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.thread_time
NATIVE_CLOCKS = {time.perf_counter: time.CLOCK_MONOTONIC, time.thread_time: time.CLOCK_THREAD_CPUTIME_ID}


@dataclass
class KernelTimes:
    """Seconds inside the compiled kernels, by kind."""

    matmul: float = 0.0
    other: float = 0.0
    per_name: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        if name.startswith("tm_gguf_matmul"):
            self.matmul += seconds
        else:
            self.other += seconds
        self.per_name[name] = self.per_name.get(name, 0.0) + seconds


@contextmanager
def timed_kernels(times: KernelTimes) -> Iterator[None]:
    """Within: every eager kernel call and every replayed one adds its wall time to `times`."""
    from tokenmill.workers import cpu_graphs

    def timer(name: str, function: Callable[..., int]) -> Callable[..., int]:
        def call(*args: object) -> int:
            started = clock()
            status = function(*args)
            times.add(name, clock() - started)
            return int(status)

        return call

    def timed_replay(recorded: cpu_graphs.RecordedCalls) -> None:  # the replay's own loop, timing each call
        if recorded.native is not None:  # the native loop times its calls itself, on the same clock
            nanos = np.zeros(len(recorded.native.names), dtype=np.int64)
            recorded.native.run(nanos, NATIVE_CLOCKS[clock])
            for name, spent in zip(recorded.native.names, nanos.tolist(), strict=True):
                times.add(name, spent * 1e-9)
            return
        for function, args in recorded.calls:
            started = clock()
            if function(*args) != 0:
                raise RuntimeError(f"{function.__name__} refused its recorded arguments")
            times.add(function.__name__, clock() - started)

    replaced = []
    for lib, signatures in cpu_graphs._kernel_libraries():
        for name in signatures:
            function = getattr(lib, name)
            replaced.append((lib, name, function))
            setattr(lib, name, timer(name, function))
    original_replay, cpu_graphs.replay_calls = cpu_graphs.replay_calls, timed_replay
    try:
        yield
    finally:
        cpu_graphs.replay_calls = original_replay
        for lib, name, function in replaced:
            setattr(lib, name, function)


def timed_step(driver: DecodeDriver) -> float:
    started = clock()
    driver.step()
    return clock() - started


def worker_figures(
    model: str, context_len: int, steps: int, rounds: int, kv_cache_dtype: str
) -> dict[str, dict[str, float]]:
    """{mode: {"step", "matmul", "other", "python"}} in ms per token (medians over rounds)."""
    num_blocks = 4 + -(-(context_len + 2 * steps * rounds * 4) // 16)
    runner, _ = build_runner(model, "auto", num_blocks, 16, kv_cache_dtype=kv_cache_dtype)
    runner.capture_cuda_graphs()
    if runner.decode_graphs is None:
        raise SystemExit("the worker recorded no CPU decode steps (see the log): nothing to compare")
    from tokenmill.workers.step_forward import SingleStageForward

    forwards = {"recorded": runner.forward, "eager": SingleStageForward(runner.model, runner.kv_cache, None)}
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20_000, context_len)]
    driver = DecodeDriver(runner, [prompt], 2 * steps * rounds * 2, 16)
    samples: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            runner.forward = forwards[mode]
            wall = statistics.median(timed_step(driver) for _ in range(steps))
            times = KernelTimes()
            with timed_kernels(times):
                for _ in range(steps):
                    driver.step()
            figures = {"step": wall, "matmul": times.matmul / steps, "other": times.other / steps}
            figures.update({f"kernel {name}": seconds / steps for name, seconds in times.per_name.items()})
            figures["python"] = wall - figures["matmul"] - figures["other"]
            for name, value in figures.items():
                samples[mode].setdefault(name, []).append(value * 1e3)
    runner.forward = forwards["recorded"]
    return {mode: {k: statistics.median(v) for k, v in figures.items()} for mode, figures in samples.items()}


def print_kernels(worker: dict[str, dict[str, float]]) -> None:
    """Each kernel's ms per token, per mode."""
    for mode in MODES:
        kernels = sorted((value, key) for key, value in worker[mode].items() if key.startswith("kernel "))
        cells = ", ".join(f"{key.removeprefix('kernel tm_')} {value:.3f}" for value, key in reversed(kernels))
        print(f"{mode} kernels, ms per token: {cells}")


def engine_figures(
    model: str, context_len: int, tokens: int, rounds: int, kv_cache_dtype: str
) -> dict[str, dict[str, float]]:
    """{mode: {"step", "model", "interval"}} in ms per decode step, from the engine's processes."""
    from tokenmill.llm import LLM
    from tokenmill.messages import SamplingParams, StepOutputs

    prompt = [int(t) for t in np.random.default_rng(1).integers(100, 20_000, context_len)]
    engines = {
        mode: LLM(model, enforce_eager=mode == "eager", max_num_seqs=8, kv_cache_dtype=kv_cache_dtype) for mode in MODES
    }
    samples: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    try:
        for _ in range(rounds):
            for mode, llm in engines.items():
                arrivals: list[float] = []

                def arrived(outputs: StepOutputs, arrivals: list[float] = arrivals) -> None:
                    if outputs.outputs:
                        arrivals.append(time.perf_counter())

                llm.step_listener = arrived
                per_length = {}
                for length in (1, 1 + tokens):
                    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
                    before = llm.engine_stats()
                    arrivals.clear()
                    llm.generate([prompt], params, use_tqdm=False)
                    per_length[length] = llm.engine_stats().since(before)
                short, long = per_length[1], per_length[1 + tokens]
                decode_steps = long.num_steps - short.num_steps
                figures = {
                    "step": (long.step_time_s - short.step_time_s) / decode_steps,
                    "model": (long.model_time_s - short.model_time_s) / decode_steps,
                    "interval": statistics.median(np.diff(arrivals[1:])),
                }
                for name, value in figures.items():
                    samples[mode].setdefault(name, []).append(value * 1e3)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return {mode: {k: statistics.median(v) for k, v in figures.items()} for mode, figures in samples.items()}


def scheduler_ms(steps: int = 200) -> float:
    """The scheduler's own `schedule()` + `update()` per decode step of one request, in ms (median)."""
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
    from tokenmill.messages import EngineRequest, SamplingParams, StepResult
    from tokenmill.model_source import resolve_config
    from tokenmill.scheduler.scheduler import Scheduler

    config = resolve_config(EngineConfig(model=ModelConfig(model=""), cache=CacheConfig(num_kv_blocks=64)))
    scheduler = Scheduler(config, 64, [])
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    scheduler.add_request(EngineRequest(request_id="r", prompt_token_ids=list(range(100, 300)), sampling=params))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.update(plan, StepResult(plan.step_id, ["r"], [1234]))
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1e3


def frontend_ms(tokens: int = 200) -> float:
    """The frontend's incremental detokenization of one token and its SSE chunk's encoding, in ms (median)."""
    import msgspec

    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.frontend.detokenizer import IncrementalDetokenizer
    from tokenmill.frontend.tokenizer import load_tokenizer
    from tokenmill.messages import SamplingParams
    from tokenmill.model_source import resolve_config

    tokenizer = load_tokenizer(resolve_config(EngineConfig(model=ModelConfig(model=""))).model)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)[:tokens]
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:8], SamplingParams(max_tokens=tokens))
    times = []
    for index, token in enumerate(ids):
        started = time.perf_counter()
        text = detokenizer.update([token]).text
        chunk = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}], "n": index}
        _ = b"data: " + msgspec.json.encode(chunk) + b"\n\n"
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def print_table(worker: dict, engine: dict, scheduler: float, hops: dict[str, float], frontend: float) -> None:
    print("| part | " + " | ".join(f"{m} ms/token | {m} %" for m in MODES) + " |")
    print("| --- |" + " ---: | ---: |" * len(MODES))
    rows: dict[str, list[float]] = {}
    for mode in MODES:
        w, e = worker[mode], engine[mode]
        parts = {
            "worker: GGUF matmul kernels": w["matmul"],
            "worker: other kernels (attention, KV write, norms, rotary, SiLU)": w["other"],
            "worker: Python and small ops": w["python"],
            "scheduler: schedule + update": scheduler,
            "messages: plan → worker → result (round trip)": hops["plan_result"],
            "messages: outputs → frontend (round trip)": hops["outputs"],
            "frontend: detokenize + SSE chunk": frontend,
        }
        total = sum(parts.values())
        for name, value in parts.items():
            rows.setdefault(name, []).extend([value, 100 * value / total])
        rows.setdefault("total (sum of the above)", []).extend([total, 100.0])
    for name, cells in rows.items():
        figures = (f"{c:.3f}" if i % 2 == 0 else f"{c:.0f}%" for i, c in enumerate(cells))
        print(f"| {name} | " + " | ".join(figures) + " |")
    for mode in MODES:
        w, e = worker[mode], engine[mode]
        print(
            f"{mode}: worker step in-process {w['step']:.3f} ms (non-matmul {w['step'] - w['matmul']:.3f} ms); "
            f"engine (wall; means, inflated by any wait for a core): scheduler step {e['step']:.3f} ms, "
            f"worker-reported {e['model']:.3f} ms, their difference {e['step'] - e['model']:.3f} ms; "
            f"median interval between the client's outputs {e['interval']:.3f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a model directory or GGUF file (default: the shipped one)")
    parser.add_argument("--context-len", type=int, default=200)
    parser.add_argument("--kv-cache-dtype", default="auto", help="as `tokenmill serve` (float16: half the KV bytes)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per worker round")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per engine round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="the worker figures' clock")
    parser.add_argument("--skip-engine", action="store_true", help="only the in-process parts")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    load = os.getloadavg()
    print(f"load average before: {load}; {threads} compute thread(s); worker figures on the {args.clock} clock")
    worker = worker_figures(args.model, args.context_len, args.steps, args.rounds, args.kv_cache_dtype)
    zero = {"step": 0.0, "model": 0.0, "interval": 0.0}
    engine = {m: zero for m in MODES}
    if not args.skip_engine:
        engine = engine_figures(args.model, args.context_len, args.tokens, args.rounds, args.kv_cache_dtype)
    print_table(worker, engine, scheduler_ms(), message_round_trips_ms(), frontend_ms())
    print_kernels(worker)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
