"""An encoder pooling instance's default step budget (`POOLING_ENCODER_MAX_NUM_BATCHED_TOKENS`): raised only when
--max-num-batched-tokens is not given, only for encoders (a decoder embedder's scratch KV cache grows with it)."""

from __future__ import annotations

from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.cross_encoders import build_bert_cross_encoder
from tokenmill.cli import build_parser, config_from_args
from tokenmill.config import POOLING_ENCODER_MAX_NUM_BATCHED_TOKENS, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.model_source import resolve_config

GENERIC = SchedulerConfig().max_num_batched_tokens


def _budget(model: str, task: str, given: int | None) -> int:
    scheduler = SchedulerConfig() if given is None else SchedulerConfig(max_num_batched_tokens=given)
    config = EngineConfig(model=ModelConfig(model=model, task=task), scheduler=scheduler)
    return resolve_config(config, step_budget_given=given is not None).scheduler.max_num_batched_tokens


def test_cross_encoder_defaults_to_the_pooling_budget(tmp_path):
    model = str(build_bert_cross_encoder(tmp_path))
    assert POOLING_ENCODER_MAX_NUM_BATCHED_TOKENS > GENERIC
    assert _budget(model, "score", None) == POOLING_ENCODER_MAX_NUM_BATCHED_TOKENS
    assert _budget(model, "auto", None) == POOLING_ENCODER_MAX_NUM_BATCHED_TOKENS
    assert _budget(model, "score", GENERIC) == GENERIC  # an explicit budget is kept, even the generic default's value
    assert _budget(model, "score", 4096) == 4096


def test_decoder_embedder_keeps_the_generic_budget(tmp_path):
    model = str(build_tiny_checkpoint("qwen3", tmp_path))
    assert _budget(model, "embed", None) == GENERIC
    assert _budget(model, "generate", None) == GENERIC


def test_cli_tells_a_given_budget_from_none():
    parser = build_parser()
    unset = parser.parse_args(["serve", "m"])
    assert unset.max_num_batched_tokens is None
    assert config_from_args(unset).scheduler.max_num_batched_tokens == GENERIC
    given = parser.parse_args(["serve", "m", "--max-num-batched-tokens", "1024"])
    assert config_from_args(given).scheduler.max_num_batched_tokens == 1024
