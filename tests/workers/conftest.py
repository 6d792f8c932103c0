"""Fixtures for worker tests: tiny random checkpoints, built once per session and shared."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(kind, max_shard_size=None)` -> (checkpoint directory, float32 HF reference model)."""
    made: dict[tuple[str, str | None], tuple[Path, object]] = {}

    def get(kind: str, max_shard_size: str | None = None):
        key = (kind, max_shard_size)
        if key not in made:
            directory = tmp_path_factory.mktemp(f"{kind}-{max_shard_size or 'single'}")
            made[key] = (directory, make_tiny_checkpoint(kind, directory, max_shard_size=max_shard_size))
        return made[key]

    return get


@pytest.fixture
def use_cpu_backend(monkeypatch):
    """`use_cpu_backend("kernels" | "torch")` makes `attention_backend("cpu")` that backend until the test ends."""
    from tokenmill.workers import backends

    expected = {"kernels": "CpuKernelBackend", "torch": "TorchAttentionBackend"}

    def use(name: str):
        monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "1" if name == "kernels" else "0")
        backends.device_kernels.cache_clear()
        backend = backends.attention_backend("cpu")
        assert type(backend).__name__ == expected[name], "the CPU kernels did not build (see the log)"
        return backend

    yield use
    backends.device_kernels.cache_clear()
