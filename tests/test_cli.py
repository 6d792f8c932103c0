"""`tokenmill serve` flags: every flag `--help` lists changes the config, and every config field is read."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import msgspec
import pytest

from tokenmill.cli import build_parser, config_from_args
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig

REPO = Path(__file__).resolve().parent.parent


def serve_actions() -> list[argparse.Action]:
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return [a for a in serve._actions if not isinstance(a, argparse._HelpAction)]


def other_value(action: argparse.Action) -> list[str]:
    """Arguments that give `action` a value other than its default."""
    flag = action.option_strings[0] if action.option_strings else None
    if flag is None:
        return ["some/model"]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [f"--no-{flag[2:]}" if action.default else flag]
    if action.nargs == 0:
        return [flag]
    special = {
        "--allowed-origins": '["*"]',
        "--api-key": "secret",
        "--tokenizer": "some/tokenizer",
        "--chat-template": "{{ messages }}",
        "--host": "127.0.0.2",
        "--speculative-config": '{"method": "ngram", "num_speculative_tokens": 3}',
        "--max-queue-time": "30",
        "--request-timeout": "60",
        "--lora-modules": "adapter=/some/folder",
        "--max-loras": "2",
        "--max-lora-rank": "32",
        "--max-cpu-loras": "4",
        "--lora-dtype": "bfloat16",  # its default is None, standing for auto: the first choice would restate it
        "--hf-overrides": '{"architectures": ["Qwen3ForSequenceClassification"]}',
        "--long-prefill-token-threshold": "96",
    }
    if flag in special:
        return [flag, special[flag]]
    if action.choices:
        return [flag, str(next(c for c in action.choices if c != action.default and c not in ("half", "float")))]
    if isinstance(action.default, float):
        return [flag, str(action.default / 2)]
    if isinstance(action.default, int):
        return [flag, str(action.default + 1)]
    return [flag, "x"]


@pytest.mark.parametrize("action", serve_actions(), ids=lambda a: a.option_strings[0] if a.option_strings else "MODEL")
def test_every_serve_flag_changes_the_config(action, monkeypatch):
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    parser = build_parser()
    # a flag that restates a default is measured against the flag it undoes
    base = ["--enable-log-requests"] if "--disable-log-requests" in action.option_strings else []
    default = config_from_args(parser.parse_args(["serve", *base]))
    changed = config_from_args(parser.parse_args(["serve", *base, *other_value(action)]))
    assert changed != default, f"{action.option_strings or action.dest} has no effect on the config"


def test_vllm_spellings_are_accepted():
    args = build_parser().parse_args(["serve", "m", "--disable-log-requests", "--dtype", "half", "-tp", "2"])
    config = config_from_args(args)
    assert not config.server.enable_log_requests and config.model.dtype == "float16"
    assert config.parallel.tensor_parallel_size == 2


CONFIG_STRUCTS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, ServerConfig, EngineConfig)


def test_every_config_field_is_read_outside_the_config_and_the_cli():
    """A field that only the CLI writes and nothing reads is a flag without an effect."""
    read: set[str] = set()
    for folder in ("tokenmill", "frontend", "scheduler", "workers", "kernels"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name in ("config.py", "cli.py"):
                continue
            read |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
    unread = [
        f"{cls.__name__}.{field.name}"
        for cls in CONFIG_STRUCTS
        for field in msgspec.structs.fields(cls)
        if field.name not in read
    ]
    assert unread == []


def test_an_unsupported_architecture_fails_at_once_naming_it_and_the_supported_ones(tmp_path):
    import subprocess
    import sys

    (tmp_path / "config.json").write_text('{"architectures": ["FooForCausalLM"], "model_type": "foo"}')
    done = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", str(tmp_path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    [line] = done.stderr.strip().splitlines()
    assert "FooForCausalLM is not supported" in line and "LlamaForCausalLM" in line and "Qwen3ForCausalLM" in line
