"""LoRA adapters at the HTTP frontend (over the fake engine): `model` names the base or an adapter, /v1/models lists
adapters under their parent, runtime load/unload with vLLM's bodies and status codes, and vllm:lora_requests_info."""

from __future__ import annotations

import msgspec
import openai
import pytest

from tests.helpers.frontend_fakes import FakeEngine
from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tests.helpers.lora_folders import write_lora_adapter
from tokenmill.config import EngineConfig, LoRAConfig, LoRAModule
from tokenmill.frontend.server import build_app
from tokenmill.messages import SchedulerStats


@pytest.fixture
def adapters(tmp_path):
    return {name: str(write_lora_adapter(tmp_path / name, rank=8, seed=i)) for i, name in enumerate(("sql", "chat"))}


async def post_text(h, path: str, body: dict, headers: dict | None = None) -> tuple[int, str]:
    """The load/unload endpoints answer success in plain text, as vLLM's."""
    async with h.http.post(h.url(path), json=body, headers=headers) as resp:
        return resp.status, await resp.text()


def lora_config(adapters: dict[str, str], runtime: bool = True, **fields) -> LoRAConfig:
    return LoRAConfig(
        enable_lora=True,
        lora_modules=[LoRAModule(name=name, path=path) for name, path in adapters.items()],
        allow_runtime_lora_updating=runtime,
        **fields,
    )


@async_test
async def test_each_generate_endpoint_routes_model_to_its_adapter(smollm2_model, tokenizer, adapters):
    async with serving(smollm2_model, tokenizer, lora=lora_config(adapters)) as h:
        completion = await h.client.completions.create(model="sql", prompt="Hello world", max_tokens=2)
        chat = await h.client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        status, response, _ = await h.post("/v1/responses", {"model": "sql", "input": "hi", "max_output_tokens": 2})
        base = await h.client.completions.create(model=MODEL, prompt="Hello world", max_tokens=2)
    assert (completion.model, chat.model, response["model"], base.model) == ("sql", "chat", "sql", MODEL)
    assert status == 200, response
    loras = [r.lora_request for r in h.engine.groups]
    assert [lora.lora_name if lora else None for lora in loras] == ["sql", "chat", "sql", None]
    assert loras[0] == loras[2] and loras[0].lora_path == adapters["sql"]
    assert loras[0].lora_int_id > 0 and loras[1].lora_int_id > 0 and loras[0].lora_int_id != loras[1].lora_int_id


@async_test
async def test_an_unknown_model_is_a_404_naming_it_on_every_generate_endpoint(smollm2_model, tokenizer, adapters):
    async with serving(smollm2_model, tokenizer, lora=lora_config(adapters)) as h:
        with pytest.raises(openai.NotFoundError) as raised:
            await h.client.completions.create(model="nope", prompt="Hello", max_tokens=2)
        assert "The model `nope` does not exist." in str(raised.value)
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/responses", {"input": "hi"}),
        ):
            status, error, _ = await h.post(path, {"model": "nope", **body})
            assert_error(status, error, 404, "NotFoundError", "model")
            assert error["error"]["message"] == "The model `nope` does not exist."
        await h.good_completion()  # nobody else disturbed
    assert len(h.engine.groups) == 1


@async_test
async def test_models_lists_adapters_with_their_parent_and_path(smollm2_model, tokenizer, adapters, tmp_path):
    other = str(write_lora_adapter(tmp_path / "other"))
    modules = [LoRAModule(name="sql", path=adapters["sql"]), LoRAModule(name="x", path=other, base_model_name="b")]
    async with serving(smollm2_model, tokenizer, lora=LoRAConfig(enable_lora=True, lora_modules=modules)) as h:
        models = await h.client.models.list()
    cards = {m.id: m.model_dump() for m in models.data}
    assert list(cards) == [MODEL, "sql", "x"]
    assert cards[MODEL]["parent"] is None
    assert (cards["sql"]["parent"], cards["sql"]["root"]) == (MODEL, adapters["sql"])
    assert (cards["x"]["parent"], cards["x"]["root"]) == (MODEL, other)  # vLLM: a base it does not serve is ignored


@async_test
async def test_runtime_load_then_unload(smollm2_model, tokenizer, adapters, tmp_path):
    extra = str(write_lora_adapter(tmp_path / "extra", rank=16))
    async with serving(smollm2_model, tokenizer, lora=lora_config(adapters)) as h:
        async with h.http.post(h.url("/v1/load_lora_adapter"), json={"lora_name": "extra", "lora_path": extra}) as r:
            assert (r.status, await r.text()) == (200, "Success: LoRA adapter 'extra' added successfully.")
        assert "extra" in [m.id for m in (await h.client.models.list()).data]
        await h.client.completions.create(model="extra", prompt="Hello", max_tokens=1)
        first_id = h.engine.groups[-1].lora_request.lora_int_id

        async with h.http.post(h.url("/v1/unload_lora_adapter"), json={"lora_name": "extra"}) as r:
            assert (r.status, await r.text()) == (200, "Success: LoRA adapter 'extra' removed successfully.")
        assert "extra" not in [m.id for m in (await h.client.models.list()).data]
        with pytest.raises(openai.NotFoundError):
            await h.client.completions.create(model="extra", prompt="Hello", max_tokens=1)

        assert (await post_text(h, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": extra}))[0] == 200
        await h.client.completions.create(model="extra", prompt="Hello", max_tokens=1)
    # a reload is new weights as far as any process can tell: a fresh id
    assert h.engine.groups[-1].lora_request.lora_int_id not in (first_id, *_ids_of(h.engine.groups[:-1]))


def _ids_of(groups) -> list[int]:
    return [g.lora_request.lora_int_id for g in groups if g.lora_request is not None]


@async_test
async def test_load_errors_follow_vllm(smollm2_model, tokenizer, adapters, tmp_path):
    big = str(write_lora_adapter(tmp_path / "big", rank=64))
    prefix = str(write_lora_adapter(tmp_path / "prefix", peft_type="PREFIX_TUNING"))
    no_weights = write_lora_adapter(tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    async with serving(smollm2_model, tokenizer, lora=lora_config(adapters)) as h:
        load = "/v1/load_lora_adapter"
        status, error, _ = await h.post(load, {"lora_name": "sql", "lora_path": adapters["chat"]})
        assert_error(status, error, 400, "BadRequestError", "lora_name")
        assert error["error"]["message"] == "The lora adapter 'sql' has already been loaded."
        status, error, _ = await h.post(load, {"lora_name": "gone", "lora_path": str(tmp_path / "missing")})
        assert_error(status, error, 404, "NotFoundError", "lora_path")
        status, error, _ = await h.post(load, {"lora_name": "big", "lora_path": big})
        assert_error(status, error, 400, "BadRequestError", "lora_path")
        assert "r=64" in error["error"]["message"] and "--max-lora-rank 16" in error["error"]["message"]
        for path in (prefix, str(no_weights)):
            status, error, _ = await h.post(load, {"lora_name": "bad", "lora_path": path})
            assert_error(status, error, 400, "BadRequestError", "lora_path")
        status, error, _ = await h.post(load, {"lora_name": "only-name"})
        assert_error(status, error, 400, "BadRequestError", "lora_path")
        status, error, _ = await h.post(load, {"lora_name": MODEL, "lora_path": adapters["sql"]})
        assert_error(status, error, 400, "BadRequestError", "lora_name")
        status, error, _ = await h.post("/v1/unload_lora_adapter", {"lora_name": "never"})
        assert_error(status, error, 404, "NotFoundError", "lora_name")
        assert error["error"]["message"] == "The lora adapter 'never' cannot be found."
        status, error, _ = await h.post("/v1/unload_lora_adapter", {})
        assert_error(status, error, 400, "BadRequestError", "lora_name")
        models = [m.id for m in (await h.client.models.list()).data]
        await h.good_completion()
    assert models == [MODEL, "sql", "chat"]


@async_test
async def test_runtime_updating_is_off_unless_allowed_and_behind_the_api_key(smollm2_model, tokenizer, adapters):
    async with serving(smollm2_model, tokenizer, lora=lora_config(adapters, runtime=False)) as h:
        status, error, _ = await h.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["sql"]})
        assert_error(status, error, 404, "NotFoundError")
        status, error, _ = await h.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert_error(status, error, 404, "NotFoundError")
        assert "sql" in [m.id for m in (await h.client.models.list()).data]
    async with serving(smollm2_model, tokenizer, api_key="k", lora=lora_config(adapters)) as h:
        status, error, _ = await h.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert_error(status, error, 401, "AuthenticationError")
        key = {"Authorization": "Bearer k"}
        status, text = await post_text(h, "/v1/unload_lora_adapter", {"lora_name": "sql"}, key)
        assert (status, text) == (200, "Success: LoRA adapter 'sql' removed successfully.")


@async_test
async def test_unloading_an_adapter_lets_its_running_requests_finish(smollm2_model, tokenizer, adapters):
    async with serving(smollm2_model, tokenizer, lora=lora_config(adapters)) as h:
        h.engine.step_delay_s = 0.02
        stream = await h.client.completions.create(model="sql", prompt="one two three", max_tokens=6, stream=True)
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 1:
                assert (await post_text(h, "/v1/unload_lora_adapter", {"lora_name": "sql"}))[0] == 200
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.model == "sql" for c in chunks) and len(h.engine.aborted) == 0


@async_test
async def test_embeddings_refuse_an_adapter_name(smollm2_model, tokenizer, adapters):
    embed_model = msgspec.structs.replace(smollm2_model, task="embed")
    async with serving(embed_model, tokenizer, lora=lora_config(adapters)) as h:
        status, error, _ = await h.post("/v1/embeddings", {"model": "sql", "input": "hello"})
        assert_error(status, error, 400, "BadRequestError", "model")
        status, error, _ = await h.post("/v1/embeddings", {"model": "nope", "input": "hello"})
        assert_error(status, error, 404, "NotFoundError", "model")
    assert h.engine.groups == []


@async_test
async def test_lora_requests_info_metric(smollm2_model, tokenizer, adapters):
    async with serving(smollm2_model, tokenizer, lora=lora_config(adapters, max_loras=2)) as h:
        h.engine.latest_stats = SchedulerStats(
            1, 2, 0.5, 0, 0, 0, running_lora_adapters=["chat"], waiting_lora_adapters=["chat", "sql"]
        )
        async with h.http.get(h.url("/metrics")) as resp:
            text = await resp.text()
    line = next(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters="chat"' in line
    assert 'waiting_lora_adapters="chat,sql"' in line
    assert float(line.rsplit(" ", 1)[1]) > 0


@async_test
async def test_no_lora_metric_or_routes_without_enable_lora(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer) as h:
        async with h.http.get(h.url("/metrics")) as resp:
            text = await resp.text()
        status, _, _ = await h.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    assert "lora_requests_info" not in text and status == 404


def test_an_app_with_an_unservable_adapter_fails_to_build(smollm2_model, tokenizer, tmp_path):
    big = str(write_lora_adapter(tmp_path / "big", rank=32))
    config = EngineConfig(model=smollm2_model, lora=lora_config({"big": big}))
    with pytest.raises(ValueError, match="--lora-modules big: The adapter's rank r=32"):
        build_app(config, FakeEngine(), tokenizer)


@async_test
async def test_tokenize_accepts_an_adapter_name(smollm2_model, tokenizer, adapters):
    async with serving(smollm2_model, tokenizer, lora=lora_config(adapters)) as h:
        status, by_adapter, _ = await h.post("/tokenize", {"model": "sql", "prompt": "Hello world"})
        status_base, by_base, _ = await h.post("/tokenize", {"model": MODEL, "prompt": "Hello world"})
        status_unknown, error, _ = await h.post("/tokenize", {"model": "nope", "prompt": "Hello world"})
    assert (status, status_base) == (200, 200) and by_adapter["tokens"] == by_base["tokens"]
    assert_error(status_unknown, error, 404, "NotFoundError", "model")
