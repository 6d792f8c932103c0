"""scripts/serve_pair.sh: a chat and an embedding instance (and an optional reranker) on their ports, started, used,
stopped, nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.helpers.cross_encoders import build_bert_cross_encoder
from tests.helpers.server import alive, descendants, free_port

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "serve_pair.sh"


def pair(command: str, env: dict, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), command], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def pair_env(tmp_path) -> dict:
    return {
        **os.environ,
        "TOKENMILL_PAIR_DIR": str(tmp_path),
        "PYTHON": sys.executable,
        "CHAT_PORT": str(free_port()),
        "EMBED_PORT": str(free_port()),
        "CHAT_KV_CACHE": "64MiB",
        "CHAT_ARGS": "--max-model-len 512",
        "PAIR_HOST": "127.0.0.1",
        "STOP_TIMEOUT": "20",
    }


def instance_pids(run_dir: Path) -> list[int]:
    """Both servers and every process below them."""
    pids = [int((run_dir / f"{name}.pid").read_text()) for name in ("chat", "embed")]
    return pids + [kid for pid in pids for kid in descendants(pid)]


def test_pair_serves_chat_and_embeddings_then_stops_cleanly(pair_env, tmp_path):
    started = pair("start", pair_env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "curl" in started.stdout and "/v1/embeddings" in started.stdout
        pids = instance_pids(tmp_path / "run")
        assert len(pids) >= 6  # two servers, each with a scheduler and a worker
        status = pair("status", pair_env)
        assert status.returncode == 0 and status.stdout.count("/health 200") == 2, status.stdout

        chat_url = f"http://127.0.0.1:{pair_env['CHAT_PORT']}"
        embed_url = f"http://127.0.0.1:{pair_env['EMBED_PORT']}"
        chat = requests.post(
            f"{chat_url}/v1/chat/completions",
            timeout=120,
            json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        embedding = requests.post(
            f"{embed_url}/v1/embeddings", timeout=120, json={"input": ["The cat sat on the mat.", "hello"]}
        )
        assert embedding.status_code == 200
        assert [len(d["embedding"]) for d in embedding.json()["data"]] == [384, 384]
        # each instance serves its own task only
        assert requests.post(f"{chat_url}/v1/embeddings", timeout=30, json={"input": "x"}).status_code == 400
        assert requests.post(f"{embed_url}/v1/completions", timeout=30, json={"prompt": "x"}).status_code == 400
    finally:
        stopped = pair("stop", pair_env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert [pid for pid in pids if alive(pid)] == []
    assert not list((tmp_path / "run").glob("*.pid"))
    assert "serving SmolLM2" in (tmp_path / "logs" / "chat.log").read_text()
    assert "serving all-MiniLM-L6-v2" in (tmp_path / "logs" / "embed.log").read_text()
    assert pair("status", pair_env).returncode == 3


def test_reranker_as_a_third_instance(pair_env, tmp_path):
    reranker = build_bert_cross_encoder(tmp_path / "models")
    env = {**pair_env, "RERANK_MODEL": str(reranker), "RERANK_PORT": str(free_port())}
    started = pair("start", env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "/v1/rerank" in started.stdout
        status = pair("status", env)
        assert status.returncode == 0 and status.stdout.count("/health 200") == 3, status.stdout
        pids = [int((tmp_path / "run" / f"{name}.pid").read_text()) for name in ("chat", "embed", "rerank")]
        pids += [kid for pid in pids for kid in descendants(pid)]
        ranked = requests.post(
            f"http://127.0.0.1:{env['RERANK_PORT']}/v1/rerank",
            timeout=120,
            json={"query": "Where do cats sleep?", "documents": ["On the mat.", "Paris is in France."]},
        )
        assert ranked.status_code == 200 and sorted(r["index"] for r in ranked.json()["results"]) == [0, 1]
    finally:
        stopped = pair("stop", pair_env)  # without RERANK_MODEL: the reranker's pid file still names it
    assert stopped.returncode == 0 and "rerank: stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    assert [pid for pid in pids if alive(pid)] == []
    assert not list((tmp_path / "run").glob("*.pid"))


def test_start_fails_with_the_log_tail_when_an_instance_dies(pair_env, tmp_path):
    env = {**pair_env, "EMBED_MODEL": str(tmp_path / "no-such-model")}
    started = pair("start", env)
    assert started.returncode == 1
    assert "embed exited while starting" in started.stderr and "does not exist" in started.stderr
    chat_pid = int(started.stdout.split("started chat (pid ")[1].split(",")[0])
    assert not alive(chat_pid)  # the other instance was stopped too
    assert not list((tmp_path / "run").glob("*.pid"))
