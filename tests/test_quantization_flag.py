"""`--quantization` / `LLM(quantization=...)`: inferred from the checkpoint when omitted, resolved once into the
config, and one clear sentence when it does not match the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.cli import build_parser, config_from_args
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.llm import _engine_config
from tokenmill.model_source import ModelSourceError, resolve_config, resolve_quantization


def resolved(model: str = "", quantization: str | None = None) -> str:
    """The resolved value for a checkpoint folder, or for a GGUF file when `model` is "" (reads no file)."""
    if not model:
        return resolve_quantization(quantization, Path("."), "model.gguf")
    return resolve_config(EngineConfig(model=ModelConfig(model=model, quantization=quantization))).model.quantization


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Config-only checkpoint folders (resolving reads no weights): plain, AWQ, and an unsupported method."""
    root = tmp_path_factory.mktemp("quantized-configs")
    made = {}
    for name, quant_config in {
        "plain": None,
        "awq": {"quant_method": "awq", "bits": 4},
        "bnb": {"quant_method": "bitsandbytes"},
    }.items():
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "max_position_embeddings": 256,
        }
        if quant_config:
            config["quantization_config"] = quant_config
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        made[name] = str(root / name)
    return made


def test_inferred_from_the_checkpoint(checkpoints):
    assert resolve_config(EngineConfig()).model.quantization == "gguf"  # the shipped SmolLM2 Q4_1 file
    assert resolved() == "gguf"
    assert resolved(checkpoints["plain"]) == "none"
    assert resolved(checkpoints["awq"]) == "awq"


def test_none_dequantizes_any_checkpoint_and_a_mismatch_is_one_sentence(checkpoints):
    assert resolved("", "none") == "none" and resolved(checkpoints["awq"], "none") == "none"
    assert resolved("", "gguf") == "gguf" and resolved(checkpoints["awq"], "awq") == "awq"
    with pytest.raises(
        ModelSourceError,
        match=r"^--quantization awq does not match the checkpoint, which is a GGUF "
        r"file; omit --quantization to use gguf\.$",
    ):
        resolved("", "awq")
    with pytest.raises(
        ModelSourceError, match="--quantization gguf does not match the checkpoint, which is not quantized"
    ):
        resolved(checkpoints["plain"], "gguf")
    with pytest.raises(ModelSourceError, match="which is quantized with awq"):
        resolved(checkpoints["awq"], "gptq")
    with pytest.raises(ModelSourceError, match="quantization method 'bitsandbytes' is not supported"):
        resolved(checkpoints["bnb"])


def test_flag_and_offline_argument():
    args = build_parser().parse_args(["serve", "-q", "none", "--dtype", "bfloat16"])
    config = config_from_args(args)
    assert config.model.quantization == "none" and config.model.dtype == "bfloat16"
    assert config_from_args(build_parser().parse_args(["serve"])).model.quantization is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int3"])
    assert _engine_config("", {"quantization": "gguf"}).model.quantization == "gguf"
