"""Tensor parallelism through the real processes on CPU: two worker ranks joined by gloo behind `tokenmill serve
--tensor-parallel-size 2` and `LLM(tensor_parallel_size=2)` generate what one rank and Hugging Face transformers
generate, and a rank that dies takes the whole instance down.

The default model (SmolLM2-135M: 9 query heads over 3 KV heads) runs with its KV heads split 2 + 1; the tiny Qwen2
(4 query heads over 2 KV heads, tied embeddings) with one KV head per rank. Embeddings and the LM head are
vocab-parallel in both.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir
from tests.helpers.parallel_e2e import NEW_TOKENS, assert_tp2_matches, offline_greedy
from tests.helpers.reference import complete_ids, hf_greedy_reference, load_reference_model
from tests.helpers.server import Server, alive, child_by_role

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a great forest, there lived",
]


def transformers_greedy(family: str, tiny_checkpoints, prompts: list[list[int]]) -> list:
    model = load_reference_model(family, tiny_checkpoints)
    return [hf_greedy_reference(model, prompt, NEW_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    return [smollm2_tokenizer.encode(text) for text in TEXTS]


def test_default_model_served_on_two_ranks_matches_one_rank_and_transformers(prompts, tiny_checkpoints, tmp_path):
    model = str(smollm2_dir() / SMOLLM2_GGUF)
    with Server(
        model,
        "--served-model-name",
        "m",
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float32",
        "--quantization",
        "none",
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        "256MiB",
        log_path=tmp_path / "server.log",
        startup_timeout=300,
    ) as server:
        for rank in (0, 1):
            child_by_role(server, f"worker{rank}")  # raises unless that rank's process is up
        with ThreadPoolExecutor(len(prompts)) as pool:
            tp2 = list(pool.map(lambda prompt: complete_ids(server.url, prompt, max_tokens=NEW_TOKENS), prompts))
        log = server.log_tail(50_000)
    assert "[worker0] loaded" in log and "[worker1] loaded" in log
    tp1 = offline_greedy(model, prompts, tensor_parallel_size=1)
    assert_tp2_matches(tp2, tp1, transformers_greedy("smollm2", tiny_checkpoints, prompts))


def test_tiny_qwen2_offline_on_two_ranks_matches_one_rank_and_transformers(prompts, tiny_checkpoints):
    model = str(tiny_checkpoints("qwen2"))
    tp2 = offline_greedy(model, prompts, tensor_parallel_size=2)
    tp1 = offline_greedy(model, prompts, tensor_parallel_size=1)
    assert_tp2_matches(tp2, tp1, transformers_greedy("qwen2", tiny_checkpoints, prompts))


def test_killing_rank1_mid_request_takes_the_instance_down(tiny_checkpoints, tmp_path):
    server = Server(
        str(tiny_checkpoints("llama")),
        "--served-model-name",
        "tiny",
        "--tensor-parallel-size",
        "2",
        "--kv-cache-memory-bytes",
        "64MiB",
        "--max-model-len",
        "512",
        log_path=tmp_path / "server.log",
        startup_timeout=300,
    ).start()
    try:
        kids = server.children()
        outcome: dict = {}

        def stream() -> None:  # a long generation, so rank 0 is mid-step (in an all-reduce) when rank 1 dies
            try:
                with requests.post(
                    f"{server.url}/v1/completions",
                    stream=True,
                    timeout=60,
                    json={
                        "model": "tiny",
                        "prompt": "Once upon a time",
                        "max_tokens": 500,
                        "ignore_eos": True,
                        "stream": True,
                    },
                ) as response:
                    outcome["body"] = b"".join(response.iter_content(None)).decode(errors="replace")
            except requests.RequestException as exc:
                outcome["exception"] = repr(exc)

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(1.0)
        os.kill(child_by_role(server, "worker1"), signal.SIGKILL)
        killed_at = time.monotonic()
        assert server.proc.wait(30) != 0, "the instance must exit non-zero when a rank dies"
        thread.join(15)
        assert not thread.is_alive(), "the in-flight request hung"
        assert "exception" in outcome or '"error"' in outcome.get("body", "")
        assert time.monotonic() - killed_at < 20
        time.sleep(0.5)
        assert [pid for pid in kids if alive(pid)] == [], "orphan processes left behind"
        log = server.log_tail(20_000)
        # the log names the cause: rank 1's death, or the collective it broke on rank 0
        assert "tokenmill-worker1" in log or "worker 0 failed" in log, log
    finally:
        server.stop()
