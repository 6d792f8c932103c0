"""What every handler needs, built once per app: config, engine, tokenizer, metrics, and the shared checks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tokenmill.config import EngineConfig
from tokenmill.frontend.engine_protocol import EngineClient
from tokenmill.frontend.errors import APIError
from tokenmill.frontend.generation import AdmissionControl
from tokenmill.frontend.lifecycle import ServerLifecycle
from tokenmill.frontend.lora_registry import LoRARegistry, ModelTarget
from tokenmill.frontend.metrics import FrontendMetrics
from tokenmill.frontend.offload import Offload
from tokenmill.frontend.reasoning_parsers import get_reasoning_parser
from tokenmill.frontend.tokenizer import vocab_size
from tokenmill.frontend.tool_parsers import get_tool_parser
from tokenmill.logs import request_id_var

TASK_ENDPOINTS = {
    "generate": "/v1/completions, /v1/chat/completions and /v1/responses",
    "embed": "/v1/embeddings",
    "score": "/v1/rerank, /v2/rerank, /rerank, /v1/score, /score, /v1/classify and /classify",
}
# the instance's task as the endpoints see it: both sequence-classifier tasks serve the same endpoints
_ENDPOINT_TASKS = {"embed": "embed", "classify": "score", "score": "score"}


@dataclass
class ServingContext:
    config: EngineConfig
    engine: EngineClient
    tokenizer: Any
    metrics: FrontendMetrics
    admission: AdmissionControl
    model_name: str
    max_model_len: int
    vocab_size: int
    task: str
    created: int  # when the app was built: the model card's `created`
    offload: Offload  # the threads that tokenize and render chat templates, off the event loop
    lora: LoRARegistry  # the LoRA adapters a request's `model` may name besides the base
    # loading / ready / degraded / draining, and the API requests in flight (tokenmill/serve.py drives it)
    lifecycle: ServerLifecycle = field(default_factory=lambda: ServerLifecycle("ready"))

    @classmethod
    def create(
        cls, config: EngineConfig, engine: EngineClient, tokenizer: Any, lifecycle: ServerLifecycle | None = None
    ) -> ServingContext:
        model = config.model
        if model.max_model_len <= 0:
            raise ValueError("config.model.max_model_len is unset: resolve the config (resolve_config) first")
        name = model.served_model_name or model.model or model.path
        task = _ENDPOINT_TASKS.get(model.task, "generate")
        check_parser_names(config.server)
        return cls(
            config=config,
            engine=engine,
            tokenizer=tokenizer,
            metrics=FrontendMetrics(engine, name, config.lora.max_loras if config.lora.enable_lora else None),
            admission=AdmissionControl(
                config.scheduler.max_waiting_requests  # per scheduler
                * config.parallel.data_parallel_size
            ),
            model_name=name,
            max_model_len=model.max_model_len,
            vocab_size=vocab_size(tokenizer),
            task=task,
            created=int(time.time()),
            offload=Offload(),
            lora=LoRARegistry(config.lora, name),
            lifecycle=lifecycle or ServerLifecycle("ready"),
        )

    def check_model(self, requested: str | None) -> None:
        """404 unless `requested` is None, the base or a LoRA adapter (they share the tokenizer)."""
        self.lora.resolve(requested)

    def resolve_model(self, requested: str | None) -> ModelTarget:
        """The base or the LoRA adapter a generate request's `model` names; 404 naming it when neither."""
        return self.lora.resolve(requested)

    def check_base_model(self, requested: str | None) -> None:
        """As check_model, but an adapter is a 400: an endpoint the base model alone serves (embeddings)."""
        if self.lora.resolve(requested).lora_request is not None:
            raise APIError(
                400, f"The LoRA adapter `{requested}` cannot serve this endpoint; use the base model.", "model"
            )

    def require_task(self, task: str, request: web.Request) -> None:
        """A clear 400 when an endpoint belongs to another kind of instance (generation, embeddings, scores)."""
        if self.task != task:
            raise APIError(
                400,
                f"{request.path} is not served here: this instance serves the '{self.task}' task "
                f"({TASK_ENDPOINTS[self.task]}). Start an instance with --task {task} for it.",
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):  # C speed for long prompts
            return
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is out of the vocabulary (0..{self.vocab_size - 1}).", param)


def new_request_id(prefix: str) -> str:
    """A fresh request id, also made the current one for this handler's log lines (tokenmill/logs.py)."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    request_id_var.set(request_id)
    return request_id


async def read_body(request: web.Request) -> bytes:
    """The request body; aiohttp raises 413 past `client_max_size`, which the error middleware renders."""
    return await request.read()


def check_parser_names(server: Any) -> None:
    """A configured tool-call or reasoning parser that does not exist fails at start-up, not on every request."""
    try:
        if server.tool_call_parser:
            get_tool_parser(server.tool_call_parser)
        if server.reasoning_parser:
            get_reasoning_parser(server.reasoning_parser)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
