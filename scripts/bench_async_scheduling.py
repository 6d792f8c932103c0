"""Overlap scheduling's effect on the decode step: the same decode probe with `--async-scheduling` off and on, in one
run, alternating between two engines that stay loaded (the idle one only polls), so both see the same machine load.

Each probe decodes --batch equal-length requests together and times the steps where all of them decode
(`benchlib.step_timing.DecodeWindow`): the client-side step time (arrival to arrival of the steps' tokens), the
scheduler's mean step time and the worker's forward + sampling time. With overlap the scheduler's planning and
publishing run while the worker computes, so the step time nears the model time. Reports each mode's medians over
--rounds and the on/off ratios.

    python scripts/bench_async_scheduling.py --batch 32 --input-len 128 --output-len 64 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import asdict

from benchlib.results import args_as_json, make_results_dir, save_json
from benchlib.step_timing import DecodeWindow, StepRecorder
from benchlib.workload import LengthRange, build_workload


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help='as for `tokenmill serve` ("" = the default model)')
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together (and --max-num-seqs)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="probes per mode, alternating off and on")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the engines' workers (0: auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", default="bench_results")
    parser.add_argument("--name", default="async_scheduling")
    return parser.parse_args(argv)


def decode(llm, batch: int, input_len: int, output_len: int, seed: int) -> StepRecorder:
    """`batch` requests of `input_len` prompt tokens, each decoding `output_len` tokens, submitted together."""
    from tokenmill import SamplingParams

    requests = build_workload(
        llm.get_tokenizer(), batch, LengthRange(input_len, input_len), LengthRange(output_len, output_len), seed
    )
    recorder = StepRecorder()
    llm.step_listener = recorder
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    llm.generate([r.prompt_ids for r in requests], params, use_tqdm=False)
    llm.step_listener = None
    return recorder


def decode_probe(llm, batch: int, input_len: int, output_len: int, seed: int) -> DecodeWindow:
    """The timing of the steps in which all `batch` requests decode."""
    recorder = decode(llm, batch, input_len, output_len, seed)
    return recorder.decode_window({request_id for record in recorder.records for request_id in record.request_ids})


def medians(windows: list[DecodeWindow]) -> dict[str, float]:
    return {
        "wall_step_time_s": statistics.median(w.wall_step_time_s for w in windows),
        "step_time_s": statistics.median(w.step_time_s for w in windows),
        "model_time_s": statistics.median(w.model_time_s for w in windows),
        "overhead_s": statistics.median(w.overhead_s for w in windows),
    }


def main(argv: list[str] | None = None) -> int:
    from tokenmill import LLM

    args = parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engines' spawned workers read it at start-up
    folder = make_results_dir(args.result_dir, args.name)
    engine_args = {"dtype": args.dtype, "max_num_seqs": args.batch, "max_model_len": args.input_len + args.output_len}
    # prompts prefilled in whole chunks, so that every request decodes in every step of the timed window (with the
    # learnt prefill limit, prompts admitted beside decoding requests trickle in)
    engine_args["long_prefill_token_threshold"] = 0
    windows: dict[bool, list[DecodeWindow]] = {False: [], True: []}
    with (
        LLM(args.model, async_scheduling=False, **engine_args) as off,
        LLM(args.model, async_scheduling=True, **engine_args) as on,
    ):
        engines = {False: off, True: on}
        for llm in engines.values():  # warm-up: first-use compilation and allocation
            decode(llm, args.batch, args.input_len, 4, args.seed + 10_000)
        for round_index in range(args.rounds):
            for mode, llm in engines.items():
                window = decode_probe(llm, args.batch, args.input_len, args.output_len, args.seed + round_index)
                windows[mode].append(window)
                print(f"round {round_index} async_scheduling={mode}: {window}", file=sys.stderr)
    summary = {("on" if mode else "off"): medians(found) for mode, found in windows.items()}
    ratios = {key: summary["on"][key] / summary["off"][key] for key in ("wall_step_time_s", "step_time_s")}
    print(f"decode at batch {args.batch}, {args.rounds} rounds, medians:")
    for mode in ("off", "on"):
        figures = summary[mode]
        print(
            f"  async scheduling {mode:3}: step {figures['wall_step_time_s'] * 1e3:7.2f} ms at the client, "
            f"{figures['step_time_s'] * 1e3:7.2f} ms in the scheduler, model {figures['model_time_s'] * 1e3:7.2f} ms, "
            f"overhead {figures['overhead_s'] * 1e3:6.2f} ms"
        )
    print(
        f"  on / off: client step time {ratios['wall_step_time_s']:.3f}, "
        f"scheduler step time {ratios['step_time_s']:.3f}"
    )
    data = {
        "config": args_as_json(args),
        "summary": summary,
        "ratios": ratios,
        "windows": {("on" if mode else "off"): [asdict(w) for w in found] for mode, found in windows.items()},
        "load_average": os.getloadavg(),
    }
    save_json(folder, data)
    print(f"results in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
