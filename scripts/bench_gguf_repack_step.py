"""The quantized default model's forward step at T = 1, 2, 4, 8 query tokens of one request (what a speculative
verification step runs), with the GGUF weights repacked (gguf_ops.repack_rows, the default on x86) and in the file's
plain layout, in one process: the layouts take turns each round, every weight switched between two kept copies.
Times are this thread's CPU time (time.thread_time), so preemption on a shared machine does not count; the ratios
are the figures to read. One thread.

    OMP_NUM_THREADS=1 python scripts/bench_gguf_repack_step.py --rounds 5
    OMP_NUM_THREADS=1 python scripts/bench_gguf_repack_step.py --rounds 3 --tokens 1 16 --types Q4_K \
        --model ~/.cache/tokenmill/llama.cpp/models/qwen2.5-0.5b-random-Q4_K_M.gguf

`--model` runs another GGUF file; `--types` switches only the weights of those types between the layouts (the others
stay as loaded): one type's repacked kernel against its plain one, inside the model's step.

Prints each layout's median step time per T with T / T=1, plain / repacked per T, and with `--matmul` the time spent
in GGUFWeight.matmul per step (a timing wrapper around it).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_decode import build_runner, one_request_forward  # noqa: E402

from tokenmill.workers.backends import attention_backend  # noqa: E402
from tokenmill.workers.quantization.gguf import GGUFWeight  # noqa: E402

TOKENS = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="turns per layout (3 timed steps per T each)")
    parser.add_argument("--context", type=int, default=200, help="tokens already in the request's KV cache")
    parser.add_argument("--matmul", action="store_true", help="also time GGUFWeight.matmul per step")
    parser.add_argument("--model", default="", help="a GGUF file (default: the default model)")
    parser.add_argument("--types", nargs="+", default=None, help="switch only these types' weights (e.g. Q4_K)")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="query tokens per step")
    args = parser.parse_args()

    torch.set_num_threads(1)
    block_size, num_blocks = 16, 64
    runner, _ = build_runner(args.model, "auto", num_blocks, block_size)
    backend = attention_backend("cpu")
    weights = [m for m in runner.model.modules() if isinstance(m, GGUFWeight)]
    print(f"{len(weights)} GGUF weights, {sum(w.repacked for w in weights)} repacked at load")
    if args.types:
        weights = [w for w in weights if w.type_name in args.types]
        print(f"switching the {len(weights)} {'/'.join(args.types)} weights between the layouts")
    if not any(w.repacked for w in weights):
        raise SystemExit("nothing was repacked (TOKENMILL_GGUF_REPACK=0, float activations, or not x86): no A/B")
    layouts = {True: [(w.blocks, w.repacked) for w in weights], False: [(w.plain_blocks(), False) for w in weights]}

    def use(repacked: bool) -> None:
        for w, (blocks, flag) in zip(weights, layouts[repacked]):
            w.blocks, w.repacked = blocks, flag

    spent = collections.defaultdict(float)
    if args.matmul:
        plain_matmul = GGUFWeight.matmul

        def timed(self, x):
            start = time.thread_time()
            out = plain_matmul(self, x)
            spent["matmul"] += time.thread_time() - start
            return out

        GGUFWeight.matmul = timed

    ctx, tokens = args.context, args.tokens
    blocks = np.arange(1, num_blocks)[None, :]  # block 0 is the runner's padding block

    def step(t: int) -> None:
        one_request_forward(runner, backend, blocks, ctx, t)

    one_request_forward(runner, backend, blocks, 0, ctx)  # the context's K/V

    times = collections.defaultdict(list)
    matmul = collections.defaultdict(list)
    for _ in range(args.rounds):
        for repacked in (False, True):
            use(repacked)
            for t in tokens:
                step(t)
                for _ in range(3):
                    spent.clear()
                    start = time.thread_time()
                    step(t)
                    times[repacked, t].append(time.thread_time() - start)
                    matmul[repacked, t].append(spent["matmul"])
    use(True)
    for repacked in (False, True):
        median = {t: float(np.median(times[repacked, t])) * 1e3 for t in tokens}
        print(
            f"{'repacked' if repacked else 'plain':8}  "
            + "  ".join(f"T={t}: {median[t]:6.2f} ms ({median[t] / median[tokens[0]]:.2f}x)" for t in tokens)
        )
        if args.matmul:
            print(
                f"{'':8}  GGUFWeight.matmul: "
                + "  ".join(f"T={t}: {float(np.median(matmul[repacked, t])) * 1e3:.2f} ms" for t in tokens)
            )
    print(
        "plain / repacked: "
        + "  ".join(f"T={t}: {np.median(times[False, t]) / np.median(times[True, t]):.2f}x" for t in tokens)
    )


if __name__ == "__main__":
    main()
