"""The one configuration object that flows from the CLI (or `LLM(...)`) to every process.

It is a frozen msgspec Struct so the launcher can hand it to child processes as bytes.
Fields that depend on the model (resolved path, max_model_len, task) are filled in once by
`tokenmill.model_source.resolve_config` before any process starts.
"""

from __future__ import annotations

import os
from typing import Any, Literal

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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # the activation dtype
    # vLLM's --quantization: how the weights are kept; None (not given) is inferred from the checkpoint by
    # model_source.resolve_config, so every process sees one of the values; "none" runs a quantized checkpoint
    # dequantized at load (the reference path)
    quantization: Literal["gguf", "awq", "gptq", "fp8", "compressed-tensors", "none"] | None = None
    max_model_len: int = 0  # 0: take it from the model
    task: Literal["auto", "generate", "embed", "classify", "score"] = "auto"
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
    # vLLM's --hf-overrides: config.json keys replaced before the model is read (e.g. a decoder reranker's
    # architectures, classifier_from_token and is_original_qwen3_reranker)
    hf_overrides: dict[str, Any] = {}


# Tasks whose requests are encoded whole in one step and pooled, with no KV cache: embeddings, and the sequence
# classifiers (cross-encoder and decoder rerankers) behind /classify, /score and /rerank.
POOLING_TASKS = frozenset({"embed", "classify", "score"})


def is_pooling_task(task: str) -> bool:
    return task in POOLING_TASKS


KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 4 * GIB  # the KV budget on CPU (on GPU it is derived)
    enable_prefix_caching: bool = True
    num_kv_blocks: int = 0  # 0: from the budget; tests set it small to force preemption
    # vLLM's --kv-cache-dtype: "auto" is the model's dtype; float16 / bfloat16 store a float32 model's K/V in two
    # bytes each (llama.cpp's default is float16); fp8 (= fp8_e4m3) or fp8_e5m2 in one byte each, divided by
    # per-layer scales from the checkpoint (1.0 without) (kernels/kv_quant.py)
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority", "sjf"] = "fcfs"
    max_waiting_requests: int = 4096
    worker_step_timeout_s: float = 60.0  # a worker that does not answer a step this long is dead (0: never)
    # deadlines (0: none): a request still waiting to start after max_queue_time_s is refused (503); one running
    # longer than request_timeout_s (or its own `timeout`, whichever is shorter) ends with what it has
    max_queue_time_s: float = 0.0
    request_timeout_s: float = 0.0
    structured_outputs_cache_bytes: int = 512 << 20  # compiled grammars kept (scheduler/structured_outputs.py)
    # overlap scheduling (vLLM's --async-scheduling): plan step N+1 while the workers run step N; the worker feeds
    # step N's sampled tokens into N+1 itself. Steps whose requests must see their token first run synchronously.
    # None: on, except under tensor or pipeline parallelism (the other ranks would need the sampled tokens)
    async_scheduling: bool | None = None
    # while some request decodes, a step's prefill chunks take at most this many tokens of the budget, so the
    # decoders' steps stay short (vLLM's --long-prefill-token-threshold; 0: no limit, as there); None: learnt from
    # the step times so that such a step takes at most 1.5 decode steps (scheduler/prefill_limit.py)
    long_prefill_token_threshold: int | None = None


class WorkerSocketKeys(msgspec.Struct, frozen=True, kw_only=True):
    """CURVE key pairs (Z85) of one instance's tcp:// worker sockets (tokenmill/socket_security.py): the scheduler's
    (the server) and the workers' (the clients). The workers' copy has no `server_secret`."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    tensor_parallel_size: int = 1
    # the decoder layers split into this many stages (workers/pipeline_parallel.py); world = pipeline x tensor
    pipeline_parallel_size: int = 1
    # "mp": worker subprocesses on this host; "ray": Ray actors placed on a cluster (tokenmill/ray_executor.py)
    distributed_executor_backend: Literal["mp", "ray"] = "mp"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dist_host: str = "127.0.0.1"  # torch.distributed rendezvous host (rank 0's node under Ray)
    dist_port: int = 0  # torch.distributed rendezvous port, chosen free at start-up
    # "plans"/"results" -> tcp:// address the scheduler binds and the workers connect to when they run on other
    # nodes (Ray); empty: the instance's ipc:// sockets
    worker_addresses: dict[str, str] = {}
    worker_socket_keys: WorkerSocketKeys | None = None  # set with tcp:// worker_addresses: their CURVE keys
    # data parallelism (tokenmill/data_parallel.py): N engine replicas behind one frontend, which routes each request
    # by longest cached prefix, then load ("cache-aware", frontend/router.py), or in turn ("round-robin")
    data_parallel_size: int = 1
    data_parallel_rank: int = 0  # which replica a process belongs to (set per replica by the launcher)
    data_parallel_routing: Literal["cache-aware", "round-robin"] = "cache-aware"
    data_parallel_fail_fast: bool = False  # the whole instance stops when one replica dies (default: degrade)

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine: pipeline stages x tensor-parallel ranks."""
        return self.pipeline_parallel_size * self.tensor_parallel_size


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None  # every path but /health and /ping needs it (frontend/auth.py); never sent to children
    disable_metrics_auth: bool = False  # /metrics open without the key, for Prometheus scrapers
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
    max_cache_salt_bytes: int = 256  # `cache_salt`, UTF-8 (vLLM has no limit; a salt is a tenant id or a secret)
    # prompt tokens x (prompt_logprobs + 1) x n over a request's prompts: the values its prompt logprobs carry
    max_prompt_logprobs_elements: int = 1 << 23
    # a structured-output constraint's bytes (a JSON schema's without descriptions, titles and examples): building
    # its grammar takes time in proportion (issue 28); OpenAI's structured outputs cap a schema's names and values
    # at 120,000 characters
    max_structured_outputs_bytes: int = 64 << 10
    # tool calling and reasoning (vLLM's flags): which parser reads tool calls from the output, whether
    # tool_choice "auto" is served, and which parser splits reasoning from the answer (frontend/tool_choice.py)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # operations (tokenmill/serve.py, README "Operations"): SIGTERM/SIGINT drain the server, letting requests in flight
    # finish for up to shutdown_timeout_s (vLLM's --shutdown-timeout) before ending them with finish_reason "abort";
    # with restart_on_failure a dead or hung engine is replaced and its requests resumed
    # (frontend/restarting_client.py), at most max_restarts times within restart_window_s, after which the instance
    # exits non-zero as without it
    shutdown_timeout_s: float = 30.0
    restart_on_failure: bool = False
    max_restarts: int = 3
    restart_window_s: float = 300.0
    # operations: every process's log lines as text or JSON objects (tokenmill/logs.py); OpenTelemetry traces,
    # one span per request, exported over OTLP/HTTP to this URL (frontend/tracing.py; None: no tracing)
    log_format: Literal["text", "json"] = "text"
    otlp_traces_endpoint: str | None = None


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's --speculative-config (tokenmill/speculative.py parses and checks the JSON); method None: off."""

    method: Literal["ngram", "draft_model"] | None = None
    num_speculative_tokens: int = 0  # k: the most draft tokens proposed per request per step
    prompt_lookup_min: int = 0  # ngram: the shortest suffix matched against the request's earlier tokens
    prompt_lookup_max: int = 0  # ngram: the longest
    model: str = ""  # draft_model: what the user gave
    path: str = ""  # draft_model: the resolved local directory
    # vLLM's key: no request speculates while more requests than this run (None: tokenmill's CPU-tuned default,
    # scheduler/spec_decode.py MAX_SPECULATING_BATCH)
    disable_by_batch_size: int | None = None


class LoRAModule(msgspec.Struct, frozen=True, kw_only=True):
    """One adapter of vLLM's --lora-modules (`name=path`, or JSON with `base_model_name`)."""

    name: str
    path: str
    base_model_name: str | None = None


LORA_DTYPES = ("auto", "float16", "bfloat16")


class LoRAConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-LoRA serving (vLLM's flags): adapters chosen per request by `model`, `max_loras` of them resident in a
    step's slots at once, `max_cpu_loras` kept loaded in host memory (None: max_loras)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[LoRAModule] = []
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING's equivalent: /v1/load_lora_adapter and /v1/unload_lora_adapter are served
    allow_runtime_lora_updating: bool = False
    # vLLM's --lora-dtype: the slot weights' dtype; "auto" is the model's (activation) dtype. The update is summed in
    # float32 either way; a narrower dtype halves the bytes a step reads from the slots.
    lora_dtype: Literal["auto", "float16", "bfloat16"] = "auto"

    def __post_init__(self) -> None:
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    server: ServerConfig = ServerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    lora: LoRAConfig = LoRAConfig()
    ipc_dir: str = ""  # private per-instance directory for socket files, made by the launcher

    def ipc_address(self, name: str) -> str:
        return f"ipc://{os.path.join(self.ipc_dir, name)}"

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    def for_scheduler(self) -> EngineConfig:
        """What the scheduler process receives: everything but the API key (only the frontend checks it)."""
        return replace(self, server=replace(self.server, api_key=None))

    def for_workers(self) -> EngineConfig:
        """What a worker (process or Ray actor) receives: no API key, and of the CURVE keys only the workers' pair and
        the scheduler's public key."""
        keys = self.parallel.worker_socket_keys
        parallel = (
            self.parallel
            if keys is None
            else replace(self.parallel, worker_socket_keys=replace(keys, server_secret=""))
        )
        return replace(self.for_scheduler(), parallel=parallel)

    @classmethod
    def from_bytes(cls, data: bytes) -> EngineConfig:
        return msgspec.msgpack.decode(data, type=cls)


def replace(struct, **changes):
    """msgspec.structs.replace, re-exported so callers need not know the Structs are msgspec."""
    return msgspec.structs.replace(struct, **changes)
