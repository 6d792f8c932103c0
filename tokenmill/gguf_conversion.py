"""A GGUF file's tokenizer and model config as transformers reads them, converted once per file and cached.

transformers reads both through gguf's GGUFReader, which spends seconds on a tokenizer's arrays (4.6 s for
SmolLM2's file on a 2-vCPU host; the tokenizer's conversion 15 s of CPU in all), and every start needed them three
times: the frontend's tokenizer, the scheduler's grammar tokenizer, the worker's config. The conversion runs in a
short-lived child process (`python -m tokenmill.frontend.gguf_tokenizer`: the frontend process never imports torch)
into the private cache (`tokenmill/private_cache.py`), keyed by the file's path, size and modification time and
transformers' version; a lock makes a second process wait for the first's conversion instead of doing it again. The
worker only takes the config when it is already there (`cached_gguf_config`): it never waits on a conversion.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tokenmill.private_cache import UntrustedCache, cache_dir, private_dir, require_private

CACHE_FOLDER = "gguf-tokenizers"
CONFIG_FOLDER = "config"  # the model config's folder inside a converted directory
GGUF_CONVERSION_TIMEOUT_S = 600.0
GGUF_CONVERSION_FORMAT = 2  # part of the cache key: bump when gguf_tokenizer.py writes something different

log = logging.getLogger(__name__)


def convert_gguf_tokenizer(gguf_path: str, out_dir: str) -> None:
    """Write the GGUF file's tokenizer (vocabulary, merges, special tokens, chat template) as an HF tokenizer
    directory and its model config into `config/` there, in a child process so that transformers' GGUF reader (and
    torch) stays out of this one."""
    command = [sys.executable, "-m", "tokenmill.frontend.gguf_tokenizer", gguf_path, out_dir]
    done = subprocess.run(command, capture_output=True, text=True, timeout=GGUF_CONVERSION_TIMEOUT_S)
    if done.returncode != 0:
        raise ValueError(f"could not read the tokenizer of {gguf_path}: {done.stderr.strip().splitlines()[-1:]}")


def gguf_conversion_key(gguf_path: str) -> str:
    """The cache key of a GGUF file's converted tokenizer: the file (path, size, modification time) and what
    converted it (transformers' version, the conversion's format)."""
    import transformers

    st = os.stat(gguf_path)
    identity = [
        os.path.abspath(gguf_path),
        st.st_size,
        st.st_mtime_ns,
        transformers.__version__,
        GGUF_CONVERSION_FORMAT,
    ]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]


@contextmanager
def converted_gguf(gguf_path: str) -> Iterator[str]:
    """A directory holding the GGUF file's tokenizer as an HF tokenizer, and its model config in `config/`: the
    cached one, converted now if missing; a temporary one when the cache is not private (a warning says why)."""
    try:
        root = private_dir(cache_dir() / CACHE_FOLDER)
    except (UntrustedCache, OSError) as exc:
        log.warning("not caching the GGUF tokenizer (%s): converting it into a temporary directory", exc)
        with tempfile.TemporaryDirectory(prefix="tokenmill-tokenizer-") as converted:
            convert_gguf_tokenizer(gguf_path, converted)
            yield converted
        return
    key = gguf_conversion_key(gguf_path)
    target = root / key
    with open(root / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process starting beside this one waits for the conversion
        if not target.is_dir():
            partial = tempfile.mkdtemp(dir=root, prefix=f"{key}.partial-")
            try:
                convert_gguf_tokenizer(gguf_path, partial)
                os.rename(partial, target)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    require_private(target)
    yield str(target)


def cached_gguf_config(gguf_path: str) -> Path | None:
    """The folder of the GGUF file's model config (config.json) where an earlier conversion cached it, else None;
    never converts, never waits."""
    root = cache_dir() / CACHE_FOLDER
    try:
        target = root / gguf_conversion_key(gguf_path)
        require_private(root)
        require_private(target)
    except (UntrustedCache, OSError):
        return None
    config = target / CONFIG_FOLDER
    return config if (config / "config.json").is_file() else None
