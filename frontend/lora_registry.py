"""The LoRA adapters a server answers to: name -> LoRARequest, checked at start-up and at every runtime load.

A request's `model` names the base (the served model name) or an adapter (`resolve`). Each load, at start-up from
--lora-modules or through POST /v1/load_lora_adapter, gets a fresh positive `lora_int_id`, so a name unloaded and
loaded again never passes for its old weights in the workers' slots or the prefix cache. An adapter is checked here,
before any request names it: its folder holds PEFT's `adapter_config.json` (a LoRA, rank `r` at most
--max-lora-rank) and `adapter_model.safetensors`. The workers load the weights on first use (vLLM's order).

Unloading only forgets the name: requests already running carry their LoRARequest and finish with it.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenmill.config import LoRAConfig
from tokenmill.frontend.errors import APIError
from tokenmill.messages import LoRARequest

log = logging.getLogger("tokenmill.frontend")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRAAdapterError(Exception):
    """An adapter that cannot be served: `status` 404 when its folder is missing (vLLM's "No adapter found"), else
    400."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_adapter_folder(path: str, max_lora_rank: int) -> int:
    """The rank `r` of the PEFT LoRA adapter in `path`; raises LoRAAdapterError saying what is wrong with it."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(404, f"No adapter found for {path}: no such folder.")
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise LoRAAdapterError(404, f"No adapter found for {path}: it has no {ADAPTER_CONFIG}.")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LoRAAdapterError(400, f"{config_file} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(400, f"{config_file} is not a JSON object.")
    peft_type = config.get("peft_type")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(400, f"{config_file} has peft_type {peft_type!r}; only LORA adapters are served.")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(400, f"{config_file} has no positive integer rank `r` (got {rank!r}).")
    if rank > max_lora_rank:
        raise LoRAAdapterError(
            400, f"The adapter's rank r={rank} is above the server's --max-lora-rank {max_lora_rank}."
        )
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise LoRAAdapterError(400, f"{path} has no {ADAPTER_WEIGHTS} (PEFT's layout).")
    return rank


def check_lora_modules(lora: LoRAConfig, base_name: str) -> str | None:
    """One sentence on the first --lora-modules entry that cannot be served (start-up), else None."""
    for module in lora.lora_modules if lora.enable_lora else ():
        if module.name == base_name:
            return f"--lora-modules: the adapter name {module.name!r} is the served model's own name."
        try:
            check_adapter_folder(module.path, lora.max_lora_rank)
        except LoRAAdapterError as exc:
            return f"--lora-modules {module.name}: {exc.message}"
    return None


@dataclass(frozen=True)
class LoadedAdapter:
    request: LoRARequest
    parent: str  # the base model's served name: /v1/models' `parent`


@dataclass(frozen=True)
class ModelTarget:
    """What a request's `model` names: the name responses report, and the adapter (None: the base model)."""

    name: str
    lora_request: LoRARequest | None = None


class LoRARegistry:
    """The adapters of one server, by name. Not thread-safe: only the event loop touches it."""

    def __init__(self, lora: LoRAConfig, base_name: str) -> None:
        self.config = lora
        self.base_name = base_name
        self.adapters: dict[str, LoadedAdapter] = {}
        self._next_id = itertools.count(1)
        for module in lora.lora_modules if lora.enable_lora else ():
            # the CLI checked them (check_lora_modules); an app built from a config directly fails as plainly
            try:
                self.load(module.name, module.path, module.base_model_name)
            except APIError as exc:
                raise ValueError(f"--lora-modules {module.name}: {exc.message}") from None

    def resolve(self, requested: str | None) -> ModelTarget:
        """The base or the adapter `requested` names (None: the base); 404 naming it when it is neither."""
        if requested is None or requested == self.base_name:
            return ModelTarget(self.base_name)
        adapter = self.adapters.get(requested)
        if adapter is None:
            raise APIError(404, f"The model `{requested}` does not exist.", "model")
        return ModelTarget(requested, adapter.request)

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and register an adapter (vLLM's rules: 400 when the name is taken or the adapter is unservable,
        404 when its folder is missing); returns its LoRARequest with a fresh id."""
        if not self.config.enable_lora:
            raise APIError(400, "LoRA adapters are not served: start the server with --enable-lora.", "lora_name")
        if name in self.adapters or name == self.base_name:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            check_adapter_folder(path, self.config.max_lora_rank)
        except LoRAAdapterError as exc:
            raise APIError(exc.status, exc.message, "lora_path") from None
        if base_model_name not in (None, self.base_name):  # vLLM ignores a base_model_name it does not serve
            log.warning(
                "LoRA adapter %r: base_model_name %r is not the served model %r; its parent is the latter",
                name,
                base_model_name,
                self.base_name,
            )
        request = LoRARequest(name, next(self._next_id), path)
        self.adapters[name] = LoadedAdapter(request, self.base_name)
        log.info("loaded LoRA adapter %r (id %d) from %s", name, request.lora_int_id, path)
        return request

    def unload(self, name: str) -> None:
        """Forget an adapter (404 when unknown, as vLLM); requests running with it finish with it."""
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        log.info("unloaded LoRA adapter %r", name)
