"""A GGUF file's converted tokenizer and config are cached (tokenmill/gguf_conversion.py): converted once per file and
transformers version, shared by processes starting side by side, and never taken from a cache another user could
write."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import pytest

from tokenmill import gguf_conversion
from tokenmill.config import replace
from tokenmill.frontend.tokenizer import load_tokenizer
from tokenmill.gguf_conversion import CACHE_FOLDER, cached_gguf_config, converted_gguf, gguf_conversion_key
from tokenmill.private_cache import cache_dir
from tokenmill.workers.model_loader import load_hf_config


@pytest.fixture(scope="session")
def converted_once(tokenizer, smollm2_model, tmp_path_factory) -> str:
    """A directory with SmolLM2's tokenizer as conversion writes it (the real conversion, once per session)."""
    with converted_gguf(os.path.join(smollm2_model.path, smollm2_model.gguf_file)) as converted:
        saved = tmp_path_factory.mktemp("converted") / "tokenizer"
        shutil.copytree(converted, saved)
    return str(saved)


@pytest.fixture
def conversions(converted_once, monkeypatch, tmp_path) -> list[str]:
    """Conversions into a fresh cache counted: each copies `converted_once` in 0.2 s instead of converting."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []

    def convert(gguf_path: str, out_dir: str) -> None:
        calls.append(gguf_path)
        time.sleep(0.2)  # long enough for a second process's start to overlap it
        shutil.copytree(converted_once, out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(gguf_conversion, "convert_gguf_tokenizer", convert)
    return calls


def test_the_tokenizer_is_converted_once_then_read_from_the_cache(conversions, smollm2_model, tokenizer):
    first, second = load_tokenizer(smollm2_model), load_tokenizer(smollm2_model)
    assert len(conversions) == 1
    text = "Hello, world: the cache keeps 49,152 tokens."
    assert first.encode(text) == second.encode(text) == tokenizer.encode(text)
    assert first.chat_template == tokenizer.chat_template
    cached = cache_dir() / CACHE_FOLDER
    gguf_path = os.path.join(smollm2_model.path, smollm2_model.gguf_file)
    assert (cached / gguf_conversion_key(gguf_path)).is_dir()
    assert not [p for p in cached.iterdir() if ".partial-" in p.name]
    assert cached.stat().st_mode & 0o777 == 0o700


def test_a_changed_file_is_converted_again(conversions, tmp_path):
    model_file = tmp_path / "model.gguf"  # the stand-in converter never reads it: only its identity counts
    model_file.write_bytes(b"GGUF" + bytes(64))
    with converted_gguf(str(model_file)):
        pass
    with converted_gguf(str(model_file)):
        pass
    assert len(conversions) == 1
    stat = model_file.stat()
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with converted_gguf(str(model_file)):
        pass
    assert len(conversions) == 2


def test_two_loads_at_once_convert_once(conversions, tmp_path):
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"GGUF")
    seen: list[list[str]] = []

    def load() -> None:
        with converted_gguf(str(model_file)) as directory:
            seen.append(sorted(os.listdir(directory)))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(conversions) == 1 and len(seen) == 2 and seen[0] == seen[1] and "tokenizer.json" in seen[0]


def test_a_failed_conversion_leaves_nothing_behind(conversions, monkeypatch, tmp_path):
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"not a GGUF file")

    def fail(gguf_path: str, out_dir: str) -> None:
        open(os.path.join(out_dir, "tokenizer.json"), "w").close()  # half written
        raise ValueError(f"could not read the tokenizer of {gguf_path}")

    monkeypatch.setattr(gguf_conversion, "convert_gguf_tokenizer", fail)
    with pytest.raises(ValueError, match="could not read the tokenizer"):
        with converted_gguf(str(model_file)):
            pass
    left = [p.name for p in (cache_dir() / CACHE_FOLDER).iterdir()]
    assert left == [f"{gguf_conversion_key(str(model_file))}.lock"]  # no partial directory, no cached one


def test_a_cache_others_may_write_is_not_used(conversions, smollm2_model, tokenizer, caplog):
    cached = cache_dir() / CACHE_FOLDER
    cached.mkdir(parents=True)
    cached.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="tokenmill.frontend.tokenizer"):
        first, second = load_tokenizer(smollm2_model), load_tokenizer(smollm2_model)
    assert len(conversions) == 2  # converted into a temporary directory each time
    assert first.encode("Hello world") == second.encode("Hello world") == tokenizer.encode("Hello world")
    assert "not caching the GGUF tokenizer" in caplog.text and "writable by group or others" in caplog.text
    assert list(cached.iterdir()) == []


def test_the_worker_takes_the_cached_config_and_never_converts(conversions, smollm2_model):
    gguf_path = os.path.join(smollm2_model.path, smollm2_model.gguf_file)
    assert cached_gguf_config(gguf_path) is None
    from_file = load_hf_config(smollm2_model)  # nothing cached: read from the file, nothing converted
    assert conversions == []
    load_tokenizer(smollm2_model)
    assert cached_gguf_config(gguf_path) is not None
    from_cache = load_hf_config(smollm2_model)
    assert from_cache.to_dict() == from_file.to_dict() and from_cache.architectures == ["LlamaForCausalLM"]
    overridden = load_hf_config(replace(smollm2_model, hf_overrides={"rms_norm_eps": 1e-3}))
    assert overridden.rms_norm_eps == 1e-3 and len(conversions) == 1
