"""`tokenmill serve [MODEL] ...`: the command line, with vLLM's flag names, turned into one EngineConfig."""

from __future__ import annotations

import argparse
import os
import re
import sys

from tokenmill.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    replace,
)
from tokenmill.lora_cli import add_lora_args, lora_config_from_args, lora_flags_error
from tokenmill.speculative import parse_speculative_config

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a process count)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def int_or_auto(text: str) -> int | None:
    """An argparse type: `auto` (None: the engine chooses) or an integer of at least 0."""
    if text.strip().lower() == "auto":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be auto or at least 0, got {value}")
    return value


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1073741824' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 1073741824)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1 << (10 * " kmgt".index(unit or " "))))


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (vLLM's --hf-overrides)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def task_from_flags(task: str, runner: str, convert: str) -> str:
    """--task, or vLLM >= 0.10's --runner / --convert spelling of it (ValueError when they disagree)."""
    if convert in ("embed", "classify"):
        if runner == "generate":
            raise ValueError(f"--convert {convert} makes a pooling model; it cannot run with --runner generate")
        implied = convert
    elif runner == "generate":
        implied = "generate"
    elif runner == "pooling":
        if task not in ("embed", "classify", "score"):
            raise ValueError("--runner pooling needs --convert embed or --convert classify (or a pooling --task)")
        implied = task
    else:
        return task
    if task not in ("auto", implied) and not (implied == "classify" and task == "score"):
        raise ValueError(f"--task {task} contradicts --runner {runner} --convert {convert}")
    return task if task != "auto" else implied


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model")
    m.add_argument(
        "model",
        nargs="?",
        default="",
        help="HF model directory, .gguf file, or hub id (default: the shipped SmolLM2-135M-Instruct, "
        "or all-MiniLM-L6-v2 with --task embed)",
    )
    m.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    m.add_argument("--served-model-name", default="", help="the model name the API reports and accepts")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    m.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["gguf", "awq", "gptq", "fp8", "compressed-tensors", "none"],
        help="how the weights are kept (default: inferred from the checkpoint, a .gguf file or "
        "config.json's quantization_config); 'none' dequantizes a quantized checkpoint at load",
    )
    m.add_argument("--max-model-len", type=int, default=0, help="context length (default: the model's)")
    m.add_argument("--task", default="auto", choices=["auto", "generate", "embed", "classify", "score"])
    m.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument(
        "--pooling",
        choices=["mean", "cls", "last"],
        default=None,
        help="embedding pooling (default: from the model's sentence-transformers files)",
    )
    m.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalize embeddings (default: from the model's sentence-transformers files)",
    )
    m.add_argument(
        "--allow-dimensions",
        action="store_true",
        help="allow the `dimensions` embedding parameter on models that do not declare Matryoshka support",
    )
    m.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never capture CUDA graphs (CUDA) or record the decoder's kernel calls (CPU): every decode step eager",
    )
    m.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for requests that leave them unset: 'auto' (the model's "
        "generation_config.json), 'vllm' (none), or a folder holding a generation_config.json",
    )
    m.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="vLLM >= 0.10's spelling of the task: 'pooling' with --convert embed or classify",
    )
    m.add_argument("--convert", default="auto", choices=["auto", "embed", "classify", "none"])
    m.add_argument(
        "--hf-overrides",
        type=json_object,
        default={},
        help="JSON replacing config.json keys, e.g. a decoder reranker's "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}\'',
    )

    c = parser.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64])
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    c.add_argument(
        "--kv-cache-memory-bytes",
        type=parse_bytes,
        default=CacheConfig().kv_cache_memory_bytes,
        help="KV cache budget on CPU, e.g. 4GiB (on GPU it follows --gpu-memory-utilization)",
    )
    c.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=0,
        dest="num_kv_blocks",
        help="use exactly this many KV blocks (testing)",
    )
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    c.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache element type: auto (the model's dtype); float16 / bfloat16, two bytes per element under a "
        "float32 model; or fp8 (= fp8_e4m3) / fp8_e5m2, one byte per element scaled by the checkpoint's k/v scales "
        "(1.0 without)",
    )

    s = parser.add_argument_group("scheduler")
    s.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig().max_num_batched_tokens)
    s.add_argument("--max-num-seqs", type=int, default=SchedulerConfig().max_num_seqs)
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "sjf"])
    s.add_argument(
        "--max-waiting-requests",
        type=int,
        default=SchedulerConfig().max_waiting_requests,
        help="beyond this many waiting requests new ones get 429",
    )
    s.add_argument(
        "--structured-outputs-cache-bytes",
        type=int,
        default=SchedulerConfig().structured_outputs_cache_bytes,
        help="bytes of compiled structured-output grammars the scheduler keeps (each charged its "
        "constraint's size plus an estimate of the compiled grammar)",
    )
    s.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan the next step while the workers run this one (overlap scheduling); steps with a "
        "structured-output request or speculative decoding run synchronously; off with pipeline or tensor "
        "parallelism (default: on)",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=int_or_auto,
        default=SchedulerConfig().long_prefill_token_threshold,
        help="while some request decodes, a step's prefill chunks take at most this many tokens of the budget, "
        "so the decoders' inter-token gap stays short; auto (default): learnt from the workers' step times so "
        "that such a step takes about two decode steps; 0: no limit (vLLM's default)",
    )
    s.add_argument(
        "--worker-step-timeout",
        type=float,
        default=SchedulerConfig().worker_step_timeout_s,
        dest="worker_step_timeout_s",
        help="seconds a worker may take to answer one step before the instance treats it as dead and "
        "exits (the first steps get 5x: kernels may compile); 0 waits forever",
    )
    s.add_argument(
        "--max-queue-time",
        type=float,
        default=0.0,
        dest="max_queue_time_s",
        help="seconds a request may wait to start before it is refused with 503 and Retry-After (0: no limit)",
    )
    s.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        dest="request_timeout_s",
        help="seconds from arrival after which a request ends with what it has (finish_reason "
        '"length", stop_reason "timeout"); a request\'s own `timeout` may only shorten it '
        "(0: no limit)",
    )

    s.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}',
    )

    p = parser.add_argument_group("parallelism")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1)
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=positive_int,
        default=1,
        help="split the decoder layers into this many stages (world size = pipeline x tensor parallel)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        default="mp",
        choices=["mp", "ray"],
        help="mp: worker processes on this host; ray: Ray actors placed across a Ray cluster's nodes "
        "(pip install tokenmill[ray]; see docs/deploy.md)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=1,
        help="engine replicas (each a scheduler with its workers and its own KV cache) behind one frontend",
    )
    p.add_argument(
        "--data-parallel-routing",
        default="cache-aware",
        choices=["cache-aware", "round-robin"],
        help="how the frontend picks a replica: longest cached prefix, then load (SGLang's cache-aware "
        "router), or in turn",
    )
    p.add_argument(
        "--data-parallel-fail-fast",
        action="store_true",
        help="stop the instance when one replica dies (default: serve on with the others, /health says degraded)",
    )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    h = parser.add_argument_group("HTTP server")
    h.add_argument("--host", default="0.0.0.0")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument(
        "--api-key",
        default=os.environ.get("TOKENMILL_API_KEY"),
        help="require `Authorization: Bearer KEY` on every path but /health and /ping (default: $TOKENMILL_API_KEY)",
    )
    h.add_argument(
        "--disable-metrics-auth",
        action="store_true",
        help="serve /metrics without the API key (for Prometheus scrapers that carry none)",
    )
    h.add_argument("--allowed-origins", default="[]", help="CORS origins as a JSON list, e.g. '[\"*\"]'")
    h.add_argument("--max-request-body-bytes", type=parse_bytes, default=ServerConfig().max_request_body_bytes)
    h.add_argument("--enable-log-requests", action="store_true", help="log one access line per HTTP request")
    h.add_argument(
        "--disable-log-requests",
        action="store_false",
        dest="enable_log_requests",
        help="no access log (the default; accepted for vLLM's command lines)",
    )
    h.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="log lines of every process as text or as one JSON object a line (with the request id on request lines)",
    )
    h.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="export OpenTelemetry traces (one span per request) over OTLP/HTTP to this URL, e.g. "
        "http://collector:4318/v1/traces (pip install 'tokenmill[tracing]')",
    )
    h.add_argument(
        "--disable-dashboard",
        action="store_true",
        help="serve no /dashboard (the live view of the KV blocks, queues and steps) and no /debug/steps",
    )

    defaults = ServerConfig()
    t = parser.add_argument_group("chat templates")
    t.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a request's own `chat_template` (otherwise such a request is a 400)",
    )
    t.add_argument(
        "--chat-template-timeout",
        type=float,
        default=defaults.chat_template_timeout_s,
        dest="chat_template_timeout_s",
        help="seconds a chat template may render before the request gets a 400",
    )
    t.add_argument(
        "--max-chat-template-chars",
        type=int,
        default=defaults.max_chat_template_chars,
        help="characters a chat template may output (or build in one value) before the request gets a 400",
    )

    r = parser.add_argument_group("request limits (a request past one gets a 400 naming the field)")
    r.add_argument("--max-n", type=int, default=defaults.max_n, help="choices per request (`n`)")
    r.add_argument(
        "--max-logprobs",
        type=int,
        default=defaults.max_logprobs,
        help="`logprobs` (completions) and `top_logprobs` (chat)",
    )
    r.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings, help="entries of `stop`")
    r.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=defaults.max_stop_string_chars,
        help="characters of one `stop` string",
    )
    r.add_argument(
        "--max-stop-token-ids", type=int, default=defaults.max_stop_token_ids, help="entries of `stop_token_ids`"
    )
    r.add_argument("--max-logit-bias", type=int, default=defaults.max_logit_bias, help="entries of `logit_bias`")
    r.add_argument(
        "--max-json-depth",
        type=int,
        default=defaults.max_json_depth,
        help="nesting depth of free-form JSON fields (tools, chat_template_kwargs, ...)",
    )
    r.add_argument(
        "--max-cache-salt-bytes", type=int, default=defaults.max_cache_salt_bytes, help="bytes of `cache_salt` (UTF-8)"
    )
    r.add_argument(
        "--max-prompt-logprobs-elements",
        type=int,
        default=defaults.max_prompt_logprobs_elements,
        help="prompt tokens x (`prompt_logprobs` + 1) x `n`, summed over a request's prompts",
    )
    r.add_argument(
        "--max-structured-outputs-bytes",
        type=parse_bytes,
        default=defaults.max_structured_outputs_bytes,
        help="bytes of a structured-output constraint (a JSON schema's without descriptions, titles and examples)",
    )

    tools = parser.add_argument_group("tool calling and reasoning")
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        choices=_tool_call_parsers(),
        help="read tool calls from the output in this model family's format (with "
        '--enable-auto-tool-choice it serves tool_choice "auto")',
    )
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default when a request has tools): the model decides, '
        "and its calls are read with --tool-call-parser",
    )
    tools.add_argument(
        "--reasoning-parser",
        default=None,
        choices=_reasoning_parsers(),
        help="split the model's thinking (reasoning_content) from its answer (content)",
    )


def add_operations_args(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    o = parser.add_argument_group("operations (drain, restarts)")
    o.add_argument(
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout_s,
        dest="shutdown_timeout_s",
        help="on SIGTERM/SIGINT, seconds requests in flight get to finish before they end with "
        "finish_reason 'abort' (a second signal ends them at once)",
    )
    o.add_argument(
        "--restart-on-failure",
        action="store_true",
        help="when an engine process dies or hangs (--worker-step-timeout), start a fresh engine and "
        "resume every request in flight instead of exiting",
    )
    o.add_argument(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        help="with --restart-on-failure: the most restarts within --restart-window; the next failure "
        "ends the instance (exit code 1)",
    )
    o.add_argument(
        "--restart-window",
        type=float,
        default=defaults.restart_window_s,
        dest="restart_window_s",
        help="seconds over which --max-restarts is counted",
    )


def operations_settings(args: argparse.Namespace) -> dict[str, float | int | bool]:
    return {
        "shutdown_timeout_s": args.shutdown_timeout_s,
        "restart_on_failure": args.restart_on_failure,
        "max_restarts": args.max_restarts,
        "restart_window_s": args.restart_window_s,
    }


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _tool_call_parsers() -> list[str]:
    from tokenmill.frontend.tool_parsers import tool_parser_names

    return tool_parser_names()


def _reasoning_parsers() -> list[str]:
    from tokenmill.frontend.reasoning_parsers import reasoning_parser_names

    return reasoning_parser_names()


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    import json

    origins = json.loads(args.allowed_origins) if hasattr(args, "allowed_origins") else []
    server = (
        ServerConfig(
            host=args.host,
            port=args.port,
            api_key=args.api_key or None,
            allowed_origins=origins,
            disable_metrics_auth=args.disable_metrics_auth,
            max_request_body_bytes=args.max_request_body_bytes,
            enable_log_requests=args.enable_log_requests,
            disable_dashboard=args.disable_dashboard,
            trust_request_chat_template=args.trust_request_chat_template,
            chat_template_timeout_s=args.chat_template_timeout_s,
            max_chat_template_chars=args.max_chat_template_chars,
            max_n=args.max_n,
            max_logprobs=args.max_logprobs,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_chars,
            max_stop_token_ids=args.max_stop_token_ids,
            max_logit_bias=args.max_logit_bias,
            max_json_depth=args.max_json_depth,
            max_cache_salt_bytes=args.max_cache_salt_bytes,
            max_prompt_logprobs_elements=args.max_prompt_logprobs_elements,
            max_structured_outputs_bytes=args.max_structured_outputs_bytes,
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser,
            log_format=args.log_format,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
        )
        if hasattr(args, "host")
        else ServerConfig()
    )
    if hasattr(args, "shutdown_timeout_s"):
        server = replace(server, **operations_settings(args))
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            served_model_name=args.served_model_name,
            dtype=_DTYPE_ALIASES.get(args.dtype, args.dtype),
            quantization=args.quantization,
            max_model_len=args.max_model_len,
            task=task_from_flags(args.task, args.runner, args.convert),
            chat_template=args.chat_template,
            seed=args.seed,
            pooling=args.pooling,
            normalize=args.normalize,
            allow_dimensions=args.allow_dimensions,
            enforce_eager=args.enforce_eager,
            generation_config=args.generation_config,
            hf_overrides=args.hf_overrides,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_kv_blocks=args.num_kv_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling_policy=args.scheduling_policy,
            max_waiting_requests=args.max_waiting_requests,
            worker_step_timeout_s=args.worker_step_timeout_s,
            max_queue_time_s=args.max_queue_time_s,
            request_timeout_s=args.request_timeout_s,
            structured_outputs_cache_bytes=args.structured_outputs_cache_bytes,
            async_scheduling=args.async_scheduling,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            device=args.device,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            data_parallel_size=args.data_parallel_size,
            data_parallel_routing=args.data_parallel_routing,
            data_parallel_fail_fast=args.data_parallel_fail_fast,
        ),
        server=server,
        speculative=parse_speculative_config(args.speculative_config),
        lora=lora_config_from_args(args),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="An LLM serving engine with an OpenAI-compatible API."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible)")
    add_engine_args(serve)
    add_server_args(serve)
    add_operations_args(serve)
    add_lora_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        parser.error(
            f"--enable-auto-tool-choice requires --tool-call-parser (choose from {', '.join(_tool_call_parsers())})"
        )
    if (lora_error := lora_flags_error(args)) is not None:
        parser.error(lora_error)

    try:
        task_from_flags(args.task, args.runner, args.convert)
    except ValueError as exc:
        parser.error(str(exc))
    from tokenmill.model_source import ModelSourceError, resolve_config
    from tokenmill.processes import setup_logging

    setup_logging("frontend", log_format=getattr(args, "log_format", None))
    try:
        config = resolve_config(config_from_args(args))
    except ModelSourceError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 1
    from tokenmill.frontend.lora_registry import check_lora_modules

    if (lora_error := check_lora_modules(config.lora, config.model.served_model_name)) is not None:
        print(f"tokenmill: error: {lora_error}", file=sys.stderr)
        return 1
    if config.server.otlp_traces_endpoint:
        from tokenmill.frontend.tracing import missing_tracing_extra

        if (missing := missing_tracing_extra()) is not None:
            print(f"tokenmill: error: {missing}", file=sys.stderr)
            return 1
    from tokenmill.serve import serve_forever

    return serve_forever(config)


if __name__ == "__main__":
    sys.exit(main())
