"""The one configuration object that flows from the CLI (or `LLM(...)`) to every process.

It is a frozen msgspec Struct so the launcher can hand it to child processes as bytes.
Fields that depend on the model (resolved path, max_model_len, task) are filled in once by
`tokenmill.model_source.resolve_config` before any process starts.
"""

from __future__ import annotations

import os
from typing import Literal

import msgspec

GIB = 1 << 30


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = ""  # what the user gave: a directory, a .gguf file, a hub id, or "" for the default
    path: str = ""  # resolved local directory holding config/tokenizer/weights
    gguf_file: str | None = None  # file name inside `path` when the checkpoint is GGUF
    tokenizer: str | None = None
    served_model_name: str = ""
    architecture: str = ""
    hidden_size: int = 0  # resolved from the model's config (the embedding size of an embedding model)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = 0  # 0: take it from the model
    task: Literal["auto", "generate", "embed"] = "auto"
    chat_template: str | None = None  # a file or a literal Jinja template
    seed: int = 0
    # embeddings: None means "from the model's sentence-transformers files"
    pooling: Literal["mean", "cls", "last"] | None = None
    normalize: bool | None = None
    allow_dimensions: bool = False  # Matryoshka truncation for models that do not declare it
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying captured CUDA graphs
    # vLLM's --generation-config: "auto" (the model's generation_config.json), "vllm" (none), or a folder
    generation_config: str = "auto"
    # the sampling defaults read from it by resolve_config (temperature, top_p, ..., max_tokens)
    generation_defaults: dict[str, int | float] = {}


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 4 * GIB  # the KV budget on CPU (on GPU it is derived)
    enable_prefix_caching: bool = True
    num_kv_blocks: int = 0  # 0: from the budget; tests set it small to force preemption


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority", "sjf"] = "fcfs"
    max_waiting_requests: int = 4096
    worker_step_timeout_s: float = 60.0  # a worker that does not answer a step this long is dead (0: never)


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    tensor_parallel_size: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dist_port: int = 0  # torch.distributed rendezvous port, chosen free at start-up


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    allowed_origins: list[str] = []
    max_request_body_bytes: int = 32 << 20
    enable_log_requests: bool = False  # the HTTP access log, one line per request
    disable_dashboard: bool = False  # no /dashboard, /dashboard/stream, /debug/steps (frontend/dashboard.py)
    # chat templates: a request's own `chat_template` is rendered only with this (vLLM's flag); a render that runs
    # longer or builds more characters than the limits ends with a 400
    trust_request_chat_template: bool = False
    chat_template_timeout_s: float = 10.0
    max_chat_template_chars: int = 64 << 20
    # request limits: past them a request is a 400 naming the field and the limit
    max_n: int = 128  # OpenAI's
    max_logprobs: int = 20  # vLLM's --max-logprobs: completions `logprobs`, chat `top_logprobs`
    max_stop_strings: int = 128
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024  # entries
    max_json_depth: int = 64  # nesting of free-form JSON (tools, chat_template_kwargs, ...)
    # tool calling and reasoning (vLLM's flags): which parser reads tool calls from the output, whether
    # tool_choice "auto" is served, and which parser splits reasoning from the answer (frontend/tool_choice.py)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    server: ServerConfig = ServerConfig()
    ipc_dir: str = ""  # private per-instance directory for socket files, made by the launcher

    def ipc_address(self, name: str) -> str:
        return f"ipc://{os.path.join(self.ipc_dir, name)}"

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> "EngineConfig":
        return msgspec.msgpack.decode(data, type=cls)


def replace(struct, **changes):
    """msgspec.structs.replace, re-exported so callers need not know the Structs are msgspec."""
    return msgspec.structs.replace(struct, **changes)
