"""Result folders: `bench_results/<UTC timestamp>-<name>/` holding the JSON, the plots and the exact command line."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

# environment variables that change what a benchmark measures; recorded in front of the command when set
RELEVANT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")


def make_results_dir(root: str | Path, name: str) -> Path:
    """A new folder `<root>/<UTC timestamp>-<name>` with `command.txt` (the command that produced it, with the
    thread and device environment variables that were set) written."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = Path(root) / f"{stamp}-{name}"
    folder.mkdir(parents=True, exist_ok=False)
    env = [f"{var}={shlex.quote(os.environ[var])}" for var in RELEVANT_ENV if var in os.environ]
    (folder / "command.txt").write_text(" ".join([*env, shlex.join([sys.executable, *sys.argv])]) + "\n")
    return folder


def save_json(folder: Path, data: dict, file_name: str = "results.json") -> Path:
    path = folder / file_name
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def args_as_json(args: argparse.Namespace) -> dict:
    """Parsed arguments as strict-JSON values: ranges and infinite rates become strings."""

    def plain(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, (str, int, float, bool, type(None), list)):
            return value
        return str(value)

    return {key: plain(value) for key, value in vars(args).items()}
