"""Sequence classifiers' configuration, torch-free: the head's labels and activations from config.json (and
--hf-overrides), the task an architecture serves, the --runner/--convert spelling, and how texts pair."""

from __future__ import annotations

import json

import pytest

from tokenmill.cli import task_from_flags
from tokenmill.frontend.score_pairs import PairingError, score_pairs
from tokenmill.model_source import ModelSourceError, resolve_task
from tokenmill.score_config import load_score_config


def config_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_activations_follow_cross_encoder(tmp_path):
    one = load_score_config(config_dir(tmp_path, architectures=["BertForSequenceClassification"], num_labels=1))
    assert (one.num_labels, one.score_activation, one.classify_activation, one.labels) == (
        1,
        "sigmoid",
        "sigmoid",
        ["LABEL_0"],
    )
    three = load_score_config(config_dir(tmp_path, id2label={"0": "neg", "1": "neu", "2": "pos"}))
    assert (three.num_labels, three.score_activation, three.classify_activation) == (3, "identity", "softmax")
    assert three.labels == ["neg", "neu", "pos"]
    named = load_score_config(
        config_dir(tmp_path, num_labels=1, sentence_transformers={"activation_fn": "torch.nn.modules.activation.Tanh"})
    )
    assert named.score_activation == "tanh"
    legacy = load_score_config(
        config_dir(tmp_path, num_labels=1, sbert_ce_default_activation_function="torch.nn.modules.linear.Identity")
    )
    assert legacy.score_activation == "identity"
    with pytest.raises(ValueError, match="not supported"):
        load_score_config(config_dir(tmp_path, num_labels=1, sentence_transformers={"activation_fn": "my.Act"}))


def test_yes_no_reranker_from_hf_overrides(tmp_path):
    path = config_dir(tmp_path, architectures=["Qwen3ForCausalLM"])
    overrides = {"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    config = load_score_config(path, overrides)
    assert (config.num_labels, config.score_activation, config.classifier_from_token) == (1, "sigmoid", ["no", "yes"])
    assert load_score_config(path, {"classifier_from_token": ["a", "b", "c"]}).num_labels == 3
    with pytest.raises(ValueError, match="is_original_qwen3_reranker"):
        load_score_config(path, {"classifier_from_token": ["yes"], "is_original_qwen3_reranker": True})


def test_task_by_architecture():
    assert resolve_task("auto", "BertForSequenceClassification") == "score"
    assert resolve_task("classify", "XLMRobertaForSequenceClassification") == "classify"
    assert resolve_task("auto", "BertModel") == "embed"
    assert resolve_task("auto", "Qwen3ForCausalLM") == "generate"
    with pytest.raises(ModelSourceError, match="sequence classifier"):
        resolve_task("generate", "Qwen3ForSequenceClassification")
    with pytest.raises(ModelSourceError, match="no classification head"):
        resolve_task("score", "LlamaForCausalLM")


def test_runner_and_convert_spell_the_task():
    assert task_from_flags("auto", "pooling", "classify") == "classify"
    assert task_from_flags("score", "pooling", "classify") == "score"
    assert task_from_flags("auto", "auto", "embed") == "embed"
    assert task_from_flags("auto", "generate", "auto") == "generate"
    assert task_from_flags("score", "auto", "auto") == "score"
    for task, runner, convert in (("auto", "pooling", "auto"), ("embed", "pooling", "classify")):
        with pytest.raises(ValueError):
            task_from_flags(task, runner, convert)


def test_pairs_one_to_many_and_pairwise():
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], "a") == [("q", "a")]
    assert score_pairs(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    with pytest.raises(PairingError) as mismatch:
        score_pairs(["x", "y"], ["a", "b", "c"])
    assert mismatch.value.param == "text_1"
    with pytest.raises(PairingError) as empty:
        score_pairs("q", [])
    assert empty.value.param == "text_2"
