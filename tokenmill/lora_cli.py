"""`tokenmill serve`'s LoRA flags (vLLM's names) turned into the `LoRAConfig` every process receives.

`--lora-modules` takes one or more adapters per flag and may repeat, each `name=path` or vLLM's JSON form
`{"name": ..., "path": ..., "base_model_name": ...}`. Runtime loading (/v1/load_lora_adapter) is on with
`--allow-runtime-lora-updating` or `TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING=True` (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING). Every LoRA flag but `--enable-lora` needs `--enable-lora` (`lora_flags_error`).
"""

from __future__ import annotations

import argparse
import json
import os

from tokenmill.config import LORA_DTYPES, LoRAConfig, LoRAModule

RUNTIME_UPDATING_ENV = "TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"
_TRUE_WORDS = ("1", "true", "yes", "on")


def parse_lora_module(text: str) -> LoRAModule:
    """An argparse type: `name=path`, or a JSON object with `name`, `path` and optionally `base_model_name`."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
            return LoRAModule(name=fields["name"], path=fields["path"], base_model_name=fields.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(
                f'not a LoRA module: {text!r} (JSON needs "name" and "path": {exc})'
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"not a LoRA module: {text!r} (expected name=path)")
    return LoRAModule(name=name, path=path)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """The LoRA flags; those that only mean something with --enable-lora default to None, so a stray one is seen."""
    defaults = LoRAConfig()
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters of the model, chosen per request by `model`"
    )
    g.add_argument(
        "--lora-modules",
        type=parse_lora_module,
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME=PATH",
        help="adapters to serve, each name=path (a PEFT folder) or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; several per flag, and the flag may repeat',
    )
    g.add_argument(
        "--max-loras",
        type=positive_int,
        default=None,
        help=f"distinct adapters in one step, one device slot each (default {defaults.max_loras})",
    )
    g.add_argument(
        "--max-lora-rank",
        type=positive_int,
        default=None,
        help=f"the largest adapter rank `r` served; a larger adapter is refused (default {defaults.max_lora_rank})",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=positive_int,
        default=None,
        help="adapters kept loaded in host memory, at least --max-loras (default: --max-loras)",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=None,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key); "
        f"also on with {RUNTIME_UPDATING_ENV}=True",
    )
    g.add_argument(
        "--lora-dtype",
        choices=LORA_DTYPES,
        default=None,
        help="the adapters' slot weights' dtype: auto (the model's dtype), float16 or bfloat16 (half the bytes a step "
        "reads under a float32 model; the update is summed in float32) (default auto)",
    )


_NEEDS_ENABLE = {
    "lora_modules": "--lora-modules",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
    "max_cpu_loras": "--max-cpu-loras",
    "allow_runtime_lora_updating": "--allow-runtime-lora-updating",
    "lora_dtype": "--lora-dtype",
}


def lora_flags_error(args: argparse.Namespace) -> str | None:
    """One sentence when the LoRA flags cannot go together, else None."""
    if not args.enable_lora:
        given = [flag for dest, flag in _NEEDS_ENABLE.items() if getattr(args, dest) is not None]
        if given:
            return f"{', '.join(given)} needs --enable-lora"
        return None
    config = lora_config_from_args(args)
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        return f"--max-cpu-loras ({config.max_cpu_loras}) must be at least --max-loras ({config.max_loras})"
    names = [module.name for module in config.lora_modules]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        return f"--lora-modules names an adapter more than once: {', '.join(duplicates)}"
    return None


def runtime_updating_from_env() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in _TRUE_WORDS


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig:
    defaults = LoRAConfig()
    return LoRAConfig(
        enable_lora=args.enable_lora,
        max_loras=args.max_loras if args.max_loras is not None else defaults.max_loras,
        max_lora_rank=args.max_lora_rank if args.max_lora_rank is not None else defaults.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=list(args.lora_modules or []),
        allow_runtime_lora_updating=bool(args.allow_runtime_lora_updating)
        or (args.enable_lora and runtime_updating_from_env()),
        lora_dtype=args.lora_dtype or defaults.lora_dtype,
    )
