"""Where a speculative-decoding verification step's time goes, against a one-token decode step, in the worker.

One request at --context-len cached tokens on the `Worker` in this process (no scheduler or messaging), n-gram
speculation configured, so the worker records decode steps (`workers/cpu_graphs.py`) and verification steps
(`workers/cpu_verify_graphs.py`). Per step of T query tokens (T = 1: a decode step; T > 1: the token and T - 1
drafts), median over --steps steps, three modes alternating round by round on the same worker:

  recorded   verification steps replayed from their recording (as the engine runs them);
  eager      verification steps run eagerly, every kernel called from the model's Python (as before);
  decode     T = 1 only: the recorded decode step, the baseline of the ratios.

Columns: the whole `Worker.execute`, the forward (embedding and decoder), the LM head over the T rows, and the rest
(plan apply, inputs, verification of the drafts, the result). Times are the calling thread's CPU time by default
(one compute thread: all the work is on it; a shared machine's waits for a core are left out), `--clock wall`
for wall time.

    OMP_NUM_THREADS=1 python scripts/profile_verify_step.py --tokens 1,2,4,8 --context-len 200 --steps 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import torch
from profile_decode import build_runner

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
PARTS = ("step", "forward", "lm_head")
NGRAM = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 3, "prompt_lookup_max": 5}


class Timers:
    """Seconds spent in wrapped callables since the last `reset`, by name."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self.clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + self.clock() - started

        return timed

    def reset(self) -> None:
        self.seconds = {}


class VerifyDriver:
    """One request prefilled at `context_len`, then steps of T tokens that overwrite the same slots each time."""

    def __init__(self, runner: Any, context_len: int, block_size: int) -> None:
        from tokenmill.messages import NewRequestData, SamplingParams, StepPlan

        self.runner = runner
        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(100, 20_000, context_len)]
        greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        blocks = list(range(1, 2 + -(-(context_len + 16) // block_size)))
        result = runner.execute(
            StepPlan(0, [NewRequestData("r", prompt, context_len, greedy, blocks, 0, context_len)], [], [])
        )
        self.last_token = result.sampled_token_ids[0]
        self.context_len = context_len
        self.step_id = 0

    def step(self, num_tokens: int) -> None:
        from tokenmill.messages import RunningRequestData, StepPlan

        self.step_id += 1
        drafts = [int(t) for t in np.random.default_rng(self.step_id).integers(100, 20_000, num_tokens - 1)]
        new = [self.last_token] if self.step_id == 1 else []  # the request stays at context_len + 1 known tokens
        running = RunningRequestData("r", new, [], self.context_len, num_tokens, drafts)
        self.runner.execute(StepPlan(self.step_id, [], [running], []))


@contextmanager
def verification_recorded(runner: Any, recorded: bool) -> Iterator[None]:
    verify = runner.decode_graphs.verify
    limit = verify.max_tokens
    verify.max_tokens = limit if recorded else 0
    try:
        yield
    finally:
        verify.max_tokens = limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--tokens", default="1,2,4,8", help="query tokens per step (1: decode)")
    parser.add_argument("--context-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    args = parser.parse_args()
    from tokenmill.config import SpeculativeConfig

    block_size = 16
    runner, _ = build_runner(args.model, "auto", 4 + -(-(args.context_len + 16) // block_size), block_size)
    runner.config = msgspec.structs.replace(runner.config, speculative=SpeculativeConfig(**NGRAM))
    runner.capture_cuda_graphs()
    timers = Timers(CLOCKS[args.clock])
    runner.execute = timers.wrap("step", runner.execute)
    runner.sampler.compute_logits = timers.wrap("lm_head", runner.sampler.compute_logits)
    graphs = runner.decode_graphs
    graphs.run = timers.wrap("forward", graphs.run)
    runner.model.forward = timers.wrap("forward", runner.model.forward)  # eager verification
    driver = VerifyDriver(runner, args.context_len, block_size)
    tokens = [int(t) for t in args.tokens.split(",")]
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for mode in ("recorded", "eager"):
                for num_tokens in tokens:
                    key = ("decode" if num_tokens == 1 else mode, num_tokens)
                    with verification_recorded(runner, mode == "recorded"):
                        for _ in range(args.steps):
                            timers.reset()
                            driver.step(num_tokens)
                            samples.setdefault(key, []).append(dict(timers.seconds))
    print_table(samples, args)


def print_table(samples: dict[tuple[str, int], list[dict[str, float]]], args: argparse.Namespace) -> None:
    median = {
        key: {part: 1e3 * statistics.median(s.get(part, 0.0) for s in rows) for part in PARTS}
        for key, rows in samples.items()
    }
    base = median.get(("decode", 1), {}).get("step", float("nan"))
    print(
        f"one request at context {args.context_len}, {torch.get_num_threads()} thread(s), {args.clock} time, median "
        f"of {args.steps} steps x {args.rounds} rounds; ms (ratio of the step to the recorded decode step)"
    )
    print("| mode | T | step | ratio | forward | LM head | rest |")
    print("|---|---|---|---|---|---|---|")
    for (mode, num_tokens), parts in sorted(median.items(), key=lambda item: (item[0][1], item[0][0])):
        rest = parts["step"] - parts["forward"] - parts["lm_head"]
        print(
            f"| {mode} | {num_tokens} | {parts['step']:.2f} | {parts['step'] / base:.2f}x | {parts['forward']:.2f} "
            f"| {parts['lm_head']:.2f} | {rest:.2f} |"
        )


if __name__ == "__main__":
    main()
