"""The per-user cache directory (`$TOKENMILL_CACHE_DIR`, default `~/.cache/tokenmill`) and its trust check.

What is cached there is either run (the CPU kernels' shared libraries, `kernels/cpu_ops.py`) or decides how every
prompt is read (a GGUF file's converted tokenizer, `frontend/tokenizer.py`), so only a directory this user owns and
no one else may write is used: created 0700, checked on every use. Torch-free: the frontend process imports it.
"""

from __future__ import annotations

import os
from pathlib import Path


class UntrustedCache(RuntimeError):
    """A cache directory or file that another user could have written."""


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill"
    return Path(os.environ.get("TOKENMILL_CACHE_DIR", default))


def require_private(path: Path) -> None:
    """Raise UntrustedCache unless `path` belongs to this user and no one else may write it."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise UntrustedCache(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")
    if st.st_mode & 0o022:
        raise UntrustedCache(f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})")


def private_dir(directory: Path) -> Path:
    """`directory`, created 0700 where missing, checked private (UntrustedCache otherwise)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    require_private(directory)
    return directory
