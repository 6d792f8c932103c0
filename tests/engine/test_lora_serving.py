"""LoRA serving through a real server: adapters from --lora-modules and loaded at runtime answer by name through the
official `openai` client, /v1/models lists them under the base, an unknown name is a 404 naming it, an adapter above
--max-lora-rank is a 400 at load, and /metrics has vllm:lora_requests_info. Routing and errors only: the adapters'
numerics are the workers' tests."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.helpers.api_helpers import API_KEY, auth, metric_samples, strictly_valid
from tests.helpers.lora_folders import SMOLLM2_LAYERS, SMOLLM2_SHAPES, write_lora_adapter
from tests.helpers.server import Server

pytestmark = pytest.mark.slow


def smollm2_adapter(folder, rank: int = 8, seed: int = 0) -> str:
    return str(write_lora_adapter(folder, rank=rank, shapes=SMOLLM2_SHAPES, num_layers=SMOLLM2_LAYERS, seed=seed))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "sql": smollm2_adapter(root / "sql"),
        "late": smollm2_adapter(root / "late", seed=1),
        "big": smollm2_adapter(root / "big", rank=32, seed=2),
        "log": root / "server.log",
    }


@pytest.fixture(scope="module")
def server(folders):
    with Server(
        "--api-key",
        API_KEY,
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        "64MiB",
        "--enable-lora",
        "--lora-modules",
        f"sql={folders['sql']}",
        "--max-loras",
        "2",
        "--allow-runtime-lora-updating",
        log_path=folders["log"],
    ) as server:
        yield server


def post(server: Server, path: str, body: dict) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, headers=auth(), timeout=60)


def test_lora_serving_end_to_end(server, folders):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    cards = {m.id: m for m in client.models.list().data}
    base = next(name for name, card in cards.items() if card.model_dump().get("parent") is None)
    assert cards["sql"].model_dump()["parent"] == base and cards["sql"].model_dump()["root"] == folders["sql"]

    completion = strictly_valid(client.completions.create(model="sql", prompt="SELECT", max_tokens=3, temperature=0))
    assert completion.model == "sql" and completion.usage.completion_tokens == 3
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert strictly_valid(chat).model == "sql"

    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert "The model `nope` does not exist." in str(raised.value)

    too_big = post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": folders["big"]})
    assert too_big.status_code == 400 and "r=32" in too_big.json()["error"]["message"]
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": folders["late"]})
    assert loaded.status_code == 200, loaded.text
    late = client.completions.create(model="late", prompt="SELECT", max_tokens=2, temperature=0)
    assert late.model == "late" and late.choices[0].finish_reason == "length"
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert "late" not in [m.id for m in client.models.list().data]
    no_key = requests.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=10)
    assert no_key.status_code == 401

    info = [labels for (name, labels) in metric_samples(server.url) if name == "vllm:lora_requests_info"]
    assert len(info) == 1 and ("max_lora", "2") in info[0]
    assert client.completions.create(model=base, prompt="SELECT", max_tokens=1).model == base
