"""Shared fixtures: model files built or found once per test session."""

from __future__ import annotations

import os

import pytest

# Tests never reach a model hub; anything that tries must fail fast, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The test run oversubscribes its 2 cores (pytest, engines, their servers): OpenMP threads of the engines it starts
# sleep at once instead of the short spin an engine chooses on a host of its own (tokenmill/launcher.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in the interpreter. This must be decided before anything imports triton (importing
# a transformers model module does), hence here, at the top of the root conftest.
if "TRITON_INTERPRET" not in os.environ and not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from tests.helpers.checkpoints import smollm2_tokenizer

    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, smollm2_tokenizer):
    """A function family -> directory of a tiny random-weight checkpoint (llama, qwen2, qwen3), built once."""
    from tests.helpers.checkpoints import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny-models")
    return lambda family: build_tiny_checkpoint(family, root, smollm2_tokenizer)
