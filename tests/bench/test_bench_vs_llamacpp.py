"""scripts/bench_vs_llamacpp.py: both engines get the same thread count, each waits for its own readiness probe, and
the table's ratios are tokenmill over llama.cpp on the figures bench_serving.py reports."""

from __future__ import annotations

import argparse
import http.server
import threading
from pathlib import Path

import bench_vs_llamacpp as bench
import pytest


def _args(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(bench.parse_args([])), **changes})


def test_engines_run_with_the_same_threads_and_the_same_file(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    args = _args(threads=2)
    llama = bench.server_command("llama.cpp", gguf, 9001, args, tmp_path)
    mine = bench.server_command("tokenmill", gguf, 9002, args, tmp_path)
    assert llama[0] == str(tmp_path / "llama-server") and str(gguf) in llama and str(gguf) in mine
    assert llama[llama.index("-t") + 1] == "2" and llama[llama.index("-tb") + 1] == "2"
    assert llama[llama.index("-np") + 1] == mine[mine.index("--max-num-seqs") + 1] == "16"
    assert mine[mine.index("--port") + 1] == "9002"


def _summary(tpot: float, ttft: float, tok_s: float, failed: int = 0) -> dict:
    return {"tpot_ms": {"mean": tpot}, "ttft_ms": {"mean": ttft}, "output_throughput": tok_s, "failed": failed}


def test_table_divides_tokenmill_by_llamacpp(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * (1 << 20))
    mine = bench.figures(
        {"batch1": _summary(10, 700, 90), "conc16": _summary(50, 900, 80), "prefill1024": _summary(0, 3000, 0)}
    )
    theirs = bench.figures(
        {"batch1": _summary(20, 1400, 60), "conc16": _summary(0, 0, 40, 2), "prefill1024": _summary(0, 9000, 0)}
    )
    text = bench.table("default", gguf, {"tokenmill": mine, "llama.cpp": theirs})
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in text.splitlines() if line.startswith("| ")
    }
    assert rows["batch 1, in 128-256, out 128: mean TPOT (ms)"] == ["10.0", "20.0", "0.50 |"]
    assert rows["64 requests at concurrency 16: output tok/s"] == ["80.0", "40.0", "2.00 |"]
    assert rows["1,024-token prompt: mean TTFT (ms)"][2] == "0.33 |"
    assert rows["failed requests"][:2] == ["0.0", "2.0"]
    # 1 MiB per 10 ms token
    assert "tokenmill: effective weight rate at batch 1 0.1 GB/s" in text


class _Loading(http.server.BaseHTTPRequestHandler):
    """A server that answers 503 on /health (llama-server while it loads) and 200 on /ready."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/ready" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_only_a_200_counts_as_ready() -> None:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Loading)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}"
        assert bench._answers_200(url + "/ready") and not bench._answers_200(url + "/health")
    finally:
        httpd.shutdown()


def test_an_unknown_model_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown model"):
        bench.gguf_file("mystery", tmp_path, tmp_path)


def test_a_subset_of_workloads_leaves_the_others_out_of_the_table() -> None:
    assert bench.parse_args(["--workloads", "batch1"]).workloads == "batch1"
    figures = bench.figures({"batch1": _summary(10, 700, 90)})
    assert figures["batch1_tpot_ms"] == 10 and figures["failed"] == 0
    assert figures["conc16_tok_s"] != figures["conc16_tok_s"]  # nan: not run
    assert figures["prefill1024_ttft_ms"] != figures["prefill1024_ttft_ms"]


def test_llama_server_gets_an_http_thread_per_slot(tmp_path: Path) -> None:
    llama = bench.server_command("llama.cpp", tmp_path / "m.gguf", 9001, _args(), tmp_path)
    assert int(llama[llama.index("--threads-http") + 1]) >= int(llama[llama.index("-np") + 1])
