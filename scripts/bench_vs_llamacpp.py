"""tokenmill against llama.cpp's llama-server on CPU: same GGUF file, same client, same machine, one engine at a time.

For each GGUF file, each engine is started alone with the same number of compute threads, then
`scripts/bench_serving.py` (token-id prompts on /v1/completions, ignore_eos, streaming) runs three workloads:

- batch 1: one request at a time, prompts of 128-256 tokens, 128 out: mean TPOT and TTFT (what one user waits for);
- concurrency 16: 64 requests, 16 in flight, same lengths: output tokens/s;
- prefill: 1,024-token prompts, 1 token out, one at a time: mean TTFT.

The table gives both engines and tokenmill / llama.cpp. The effective weight rate (GGUF bytes / mean TPOT) says how
near batch-1 decode is to streaming the weights once per token. `llama-server` and `llama-quantize` are built once
from the llama-cpp-python sdist into ~/.cache/tokenmill/llama.cpp (about 25 minutes on 2 cores; not part of CI);
`--models` picks the files: `default` (the shipped SmolLM2-135M Q4_1), and `qwen-Q4_K_M`, `qwen-Q8_0` (a
Qwen2.5-0.5B-shaped model with random weights, converted and quantized by llama.cpp's own tools).

    python scripts/bench_vs_llamacpp.py                         # all three files, 1 thread each
    python scripts/bench_vs_llamacpp.py --models default --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchlib.launch import free_port
from benchlib.llamacpp import DEFAULT_CACHE, build_llama_cpp, qwen25_05b_gguf, smollm2_dir
from benchlib.results import make_results_dir, save_json

SCRIPTS = Path(__file__).resolve().parent
STARTUP_TIMEOUT_S = 900.0
WORKLOADS = {
    "batch1": ["--num-prompts", "8", "--input-len", "128:256", "--output-len", "128", "--max-concurrency", "1"],
    "conc16": ["--num-prompts", "64", "--input-len", "128:256", "--output-len", "128", "--max-concurrency", "16"],
    "prefill1024": ["--num-prompts", "4", "--input-len", "1024", "--output-len", "1", "--max-concurrency", "1"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default,qwen-Q4_K_M,qwen-Q8_0", help="comma-separated: default, qwen-<TYPE>")
    p.add_argument("--threads", type=int, default=1, help="compute threads of each engine")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--build-jobs", type=int, default=None)
    p.add_argument("--engines", default="tokenmill,llama.cpp")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    p.add_argument("--tokenmill-args", default="", help="extra `tokenmill serve` arguments")
    p.add_argument("--result-dir", default="bench_results")
    return p.parse_args(argv)


def gguf_file(name: str, cache: Path, bin_dir: Path) -> Path:
    if name == "default":
        return smollm2_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name.startswith("qwen-"):
        return qwen25_05b_gguf(cache, bin_dir, name.removeprefix("qwen-"))
    raise SystemExit(f"unknown model {name!r}: use default or qwen-<llama-quantize type>")


def server_command(engine: str, gguf: Path, port: int, args: argparse.Namespace, bin_dir: Path) -> list[str]:
    if engine == "tokenmill":
        serve = [sys.executable, "-m", "tokenmill.cli", "serve", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
        return [*serve, "--max-num-seqs", "16", *args.tokenmill_args.split()]
    threads = str(args.threads)
    # 16 slots of 2,048 tokens: room for every workload's prompt + output in each slot; an HTTP thread per slot
    # (the default is one per core: at concurrency 16 on 2 cores llama-server dropped connections)
    llama = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    return [*llama, "-t", threads, "-tb", threads, "-np", "16", "-c", str(16 * 2048), "--threads-http", "20"]


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def running_server(engine: str, command: list[str], threads: int, log_path: Path) -> Iterator[str]:
    """Start one engine's server alone, wait until it serves (tokenmill's /ready, llama-server's /health, which is
    503 while it loads), yield its URL, stop it."""
    port = command[command.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    ready = url + ("/ready" if engine == "tokenmill" else "/health")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not _answers_200(ready):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{engine} did not start; see {log_path}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_workload(url: str, gguf: Path, workload: str, folder: Path, name: str) -> dict:
    """One bench_serving.py run; its summary (failed requests are counted in it: bench_serving.py then exits 1, as
    llama-server does drop some at concurrency 16)."""
    command = [sys.executable, str(SCRIPTS / "bench_serving.py"), "--base-url", url, "--endpoint", "/v1/completions"]
    command += ["--tokenizer", str(gguf), "--prompt-format", "ids", "--ignore-eos", "--num-warmup", "1"]
    command += [*WORKLOADS[workload], "--result-dir", str(folder), "--name", name]
    subprocess.run(command)
    (result,) = sorted(folder.glob(f"*-{name}/results.json"))
    return json.loads(result.read_text())["runs"][0]["summary"]


def figures(summaries: dict[str, dict]) -> dict[str, float]:
    """The table's figures from the workloads that ran (nan for those that did not)."""
    nan = {"mean": float("nan")}
    batch1, prefill = summaries.get("batch1", {}), summaries.get("prefill1024", {})
    return {
        "batch1_tpot_ms": batch1.get("tpot_ms", nan)["mean"],
        "batch1_ttft_ms": batch1.get("ttft_ms", nan)["mean"],
        "conc16_tok_s": summaries.get("conc16", {}).get("output_throughput", float("nan")),
        "prefill1024_ttft_ms": prefill.get("ttft_ms", nan)["mean"],
        "failed": sum(s["failed"] for s in summaries.values()),
    }


ROWS = (
    ("batch 1, in 128-256, out 128: mean TPOT (ms)", "batch1_tpot_ms"),
    ("batch 1: mean TTFT (ms)", "batch1_ttft_ms"),
    ("64 requests at concurrency 16: output tok/s", "conc16_tok_s"),
    ("1,024-token prompt: mean TTFT (ms)", "prefill1024_ttft_ms"),
    ("failed requests", "failed"),
)


def table(model: str, gguf: Path, results: dict[str, dict[str, float]]) -> str:
    mine, theirs = results.get("tokenmill"), results.get("llama.cpp")
    lines = [f"### {model} ({gguf.name}, {gguf.stat().st_size / 2**20:.0f} MiB)", ""]
    lines += ["| workload | tokenmill | llama-server | tokenmill / llama.cpp |", "| --- | --- | --- | --- |"]
    for label, key in ROWS:
        a = mine[key] if mine else float("nan")
        b = theirs[key] if theirs else float("nan")
        lines.append(f"| {label} | {a:.1f} | {b:.1f} | {a / b if b else float('nan'):.2f} |")
    for engine, result in results.items():
        rate = gguf.stat().st_size / (result["batch1_tpot_ms"] / 1e3) / 1e9
        lines.append(f"\n{engine}: effective weight rate at batch 1 {rate:.1f} GB/s (GGUF bytes / mean TPOT)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = make_results_dir(args.result_dir, "vs-llamacpp")
    bin_dir = build_llama_cpp(args.cache_dir, args.build_jobs)
    report = {}
    for model in args.models.split(","):
        gguf = gguf_file(model, args.cache_dir, bin_dir)
        results = {}
        for engine in args.engines.split(","):
            command = server_command(engine, gguf, free_port(), args, bin_dir)
            with running_server(engine, command, args.threads, folder / f"{model}-{engine}.log") as url:
                tag = f"{model}-{engine}"
                summaries = {w: run_workload(url, gguf, w, folder, f"{tag}-{w}") for w in args.workloads.split(",")}
            results[engine] = figures(summaries)
        report[model] = results
        print(table(model, gguf, results), flush=True)
    save_json(folder, {"threads": args.threads, "results": report})
    print(f"results in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
