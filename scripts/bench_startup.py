"""Seconds from `tokenmill serve` to the first 200 on /v1/models, with the GGUF conversion cache emptied first (cold)
and then kept (warm), alternated for `--rounds` rounds.

The cache emptied is only the converted GGUF tokenizers and configs (`$TOKENMILL_CACHE_DIR/gguf-tokenizers`, see
tokenmill/gguf_conversion.py); the built CPU kernels stay. Extra arguments after `--` go to `tokenmill serve`.

    python scripts/bench_startup.py --rounds 2                       # the shipped default model
    python scripts/bench_startup.py --rounds 1 -- ./model.Q4_K_M.gguf --max-model-len 4096
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from tokenmill.gguf_conversion import CACHE_FOLDER
from tokenmill.private_cache import cache_dir


def seconds_to_ready(port: int, serve_args: list[str], timeout_s: float) -> float:
    """Start the server, poll /v1/models every 0.2 s until it answers 200, stop it (SIGTERM to its group)."""
    start = time.perf_counter()
    command = ["tokenmill", "serve", *serve_args, "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while time.perf_counter() - start < timeout_s:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"not ready within {timeout_s:.0f} s")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one start")
    args, serve_args = parser.parse_known_args()
    serve_args = [arg for arg in serve_args if arg != "--"] or ["--max-model-len", "2048"]
    for round_number in range(1, args.rounds + 1):
        shutil.rmtree(cache_dir() / CACHE_FOLDER, ignore_errors=True)
        cold = seconds_to_ready(args.port, serve_args, args.timeout)
        warm = seconds_to_ready(args.port, serve_args, args.timeout)
        print(f"round {round_number}: cold {cold:.1f} s, warm {warm:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
