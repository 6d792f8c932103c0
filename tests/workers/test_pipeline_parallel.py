"""Pipeline stages in one process: each stage builds and loads only its layers (and the embedding or the head), and
the stages chained by hand give Hugging Face's logits. The layer split and the micro-batch split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.config import ModelConfig
from tokenmill.workers.attention import build_attention_metadata
from tokenmill.workers.backends import attention_backend
from tokenmill.workers.model_loader import iter_weights
from tokenmill.workers.models.pipeline import MissingLayer, PipelineStage
from tokenmill.workers.models.registry import architecture_of, model_class
from tokenmill.workers.pipeline_parallel import micro_batches, stage_forward
from tokenmill.workers.request_state import CachedRequest, ScheduledRequest


def test_layers_split_evenly_with_the_extra_ones_before_the_last_stage():
    def ranges(layers, stages):
        return [PipelineStage(rank, stages).layer_range(layers) for rank in range(stages)]

    assert ranges(2, 2) == [(0, 1), (1, 2)]
    assert ranges(5, 2) == [(0, 3), (3, 5)]  # vLLM's split: the last stage also runs the norm and the head
    assert ranges(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert ranges(7, 1) == [(0, 7)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3"):
        PipelineStage(0, 3).layer_range(2)


def test_each_stage_owns_its_layers_the_embedding_or_the_head():
    first, last = PipelineStage(0, 2), PipelineStage(1, 2)
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.3.self_attn.q_proj.bias",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert [first.weight_name(n, 4, tied_embeddings=False) for n in names] == names[:2] + [None, None, None]
    assert [last.weight_name(n, 4, tied_embeddings=False) for n in names] == [None, None] + names[2:]
    # a tied head on a last stage without the embedding loads the embedding's tensor into its own weight
    assert last.weight_name("model.embed_tokens.weight", 4, tied_embeddings=True) == "lm_head.weight"


def scheduled(*num_tokens: int) -> list[ScheduledRequest]:
    return [
        ScheduledRequest(CachedRequest(f"r{i}", [1] * n, [], "generate", None), 0, n) for i, n in enumerate(num_tokens)
    ]


def test_micro_batches_are_contiguous_non_empty_and_about_even():
    entries = scheduled(5, 1, 1, 1, 4, 4)
    groups = micro_batches(entries, 2)
    assert [entry for group in groups for entry in group] == entries
    assert [sum(e.num_scheduled_tokens for e in group) for group in groups] == [8, 8]
    assert micro_batches(entries[:1], 4) == [entries[:1]]
    assert [len(g) for g in micro_batches(scheduled(100, 1, 1), 3)] == [1, 1, 1]
    assert [len(g) for g in micro_batches(scheduled(1, 1, 100), 2)] == [2, 1]


def test_parallel_sizes_are_checked_naming_the_field():
    from tokenmill.config import EngineConfig, ParallelConfig
    from tokenmill.config import ModelConfig as Model
    from tokenmill.launcher import check_parallel_config

    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        check_parallel_config(EngineConfig(parallel=ParallelConfig(pipeline_parallel_size=0)))
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 serves generation models only"):
        check_parallel_config(
            EngineConfig(model=Model(task="embed"), parallel=ParallelConfig(pipeline_parallel_size=2))
        )
    check_parallel_config(EngineConfig(parallel=ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2)))


def load_stage(path, hf_config, stage: PipelineStage):
    model = model_class(architecture_of(hf_config))(hf_config, pp=stage)

    def wanted(name):
        return stage.weight_name(name, hf_config.num_hidden_layers, hf_config.tie_word_embeddings)

    model.load_weights(iter_weights(ModelConfig(path=str(path)), wanted=wanted))
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama-tied-mha"])
def test_two_stages_chained_give_hf_logits(tiny_checkpoint, kind):
    path, hf_model = tiny_checkpoint(kind)
    config = hf_model.config
    stages = [load_stage(path, config, PipelineStage(rank, 2)) for rank in range(2)]
    stage0 = PipelineStage(0, 2)
    read = {
        name
        for name, _ in iter_weights(
            ModelConfig(path=str(path)),
            wanted=lambda name: (
                stage0.weight_name(name, config.num_hidden_layers, config.tie_word_embeddings) is not None
            ),
        )
    }
    others = {name for name in read if ".layers.1." in name or name in ("model.norm.weight", "lm_head.weight")}
    assert "model.layers.0.mlp.down_proj.weight" in read and others == set(), "stage 0 read another stage's tensors"
    first, last = stages
    assert isinstance(first.model.layers[1], MissingLayer) and isinstance(last.model.layers[0], MissingLayer)
    assert first.lm_head is None and isinstance(last.model.embed_tokens, MissingLayer)
    assert first.num_layers == last.num_layers == 1
    if config.tie_word_embeddings:  # the last stage's head holds its own copy of the embedding
        torch.testing.assert_close(last.lm_head.weight, hf_model.get_input_embeddings().weight)

    input_ids = torch.randint(3, config.vocab_size, (23,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0]
    block_size, num_blocks = 4, 8
    caches = []
    for stage_model in stages:  # each stage's cache holds only its own layers
        shape = stage_model.kv_cache_shape(num_blocks, block_size)
        caches.append([(torch.zeros(shape), torch.zeros(shape)) for _ in range(stage_model.num_layers)])
    blocks = np.random.default_rng(0).permutation(num_blocks)
    logits = []
    for start, end in [(0, 9), (9, 22), (22, 23)]:  # a prompt in chunks, then a decode step
        attn = build_attention_metadata(
            np.array([end - start]),
            np.array([end]),
            blocks[None, : -(-end // block_size)],
            block_size,
            torch.device("cpu"),
            attention_backend("cpu"),
        )
        ids, positions = input_ids[start:end], torch.arange(start, end)
        with torch.inference_mode():
            intermediate = stage_forward(first, PipelineStage(0, 2), ids, positions, attn, caches[0])
            assert intermediate.shape == (2, end - start, config.hidden_size)
            hidden = stage_forward(last, PipelineStage(1, 2), ids, positions, attn, caches[1], intermediate)
            logits.append(last.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=1e-4)
