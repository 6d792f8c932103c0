"""Load the served model's tokenizer and render chat messages through its chat template.

`load_tokenizer` reads an HF tokenizer directory, or the tokenizer embedded in a GGUF file; `ModelConfig.tokenizer`
names another source and `ModelConfig.chat_template` replaces the template (a file path or a literal Jinja template).

The frontend process never imports torch, and transformers' `AutoTokenizer` does (through the model configs), as
does its GGUF reader. So the class that `tokenizer_config.json` names is taken from transformers directly (the
tokenizers-backed fast class, as `AutoTokenizer` would pick), and a GGUF file's tokenizer is converted by
transformers in a short-lived child process, once per file (`tokenmill/gguf_conversion.py`: cached), then loaded
from there the same way.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.frontend.chat_template import DEFAULT_LIMITS, ChatTemplate, RenderLimits, compile_chat_template
from tokenmill.gguf_conversion import converted_gguf


def read_chat_template(value: str) -> str:
    """A literal template (it has Jinja braces) or the contents of the file it names."""
    if "{" in value:
        return value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    raise ValueError(f"chat template {value!r} is neither a Jinja template nor a readable file")


def tokenizer_class(directory: str) -> type:
    """The tokenizer class `directory/tokenizer_config.json` names, else transformers' generic fast tokenizer."""
    import transformers

    name = None
    config_file = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    for candidate in (name, name.removesuffix("Fast") if name else None):
        cls = getattr(transformers, candidate, None) if candidate else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerFast):
            return cls
    return transformers.PreTrainedTokenizerFast


def _from_source(source: str, gguf_file: str | None = None) -> Any:
    if gguf_file is None and source.endswith(".gguf") and os.path.isfile(source):
        source, gguf_file = os.path.split(os.path.abspath(source))
    if gguf_file is not None:
        with converted_gguf(os.path.join(source, gguf_file)) as converted:
            return tokenizer_class(converted).from_pretrained(converted)
    if not os.path.isdir(source):  # a hub id: fetch the tokenizer files first (honours HF_ENDPOINT)
        from huggingface_hub import snapshot_download

        source = snapshot_download(source, allow_patterns=["*.json", "*.jinja", "*.model", "*.txt"])
    return tokenizer_class(source).from_pretrained(source)


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer for `model` (resolved by `resolve_config`: `path` and `gguf_file` are filled in)."""
    if model.tokenizer:
        tokenizer = _from_source(model.tokenizer)
    else:
        tokenizer = _from_source(model.path or model.model, model.gguf_file)
    if model.chat_template:
        tokenizer.chat_template = read_chat_template(model.chat_template)
    return tokenizer


def server_chat_template(tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> ChatTemplate:
    """The served model's chat template (its own, or --chat-template's), compiled. A tokenizer may name several:
    "tool_use" serves requests with tools when it exists, "default" the rest, as transformers picks. Raises
    ValueError when the model has none."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = source.get("tool_use") if tools and "tool_use" in source else source.get("default")
    if not source:
        raise ValueError(
            "This model has no chat template; use /v1/completions or start the server with --chat-template."
        )
    return compile_chat_template(source)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    template: ChatTemplate | None = None,
    limits: RenderLimits = DEFAULT_LIMITS,
) -> str:
    """The prompt text for a conversation, through `template` (default: the server's) in the bounded sandbox.
    Raises ValueError when the model has no chat template; Jinja errors (a template's `raise_exception`, e.g. roles
    that must alternate; RenderLimitError past the limits) propagate as jinja2 TemplateError."""
    template = template or server_chat_template(tokenizer, tools)
    return template.render(
        messages,
        limits=limits,
        special_tokens=tokenizer.special_tokens_map,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        kwargs=template_kwargs,
    )


def encode_texts(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The ids of each text, in one batch call: the Rust tokenizer releases the GIL while it works."""
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return encode_texts(tokenizer, [text], add_special_tokens)[0]


def encode_text_keep_last(tokenizer: Any, text: str, add_special_tokens: bool, max_tokens: int) -> list[int]:
    """At most `max_tokens` ids of `text`, cut from the left but keeping the special tokens the tokenizer adds
    (vLLM's `truncate_prompt_tokens`, which tokenizes with truncation_side="left")."""
    previous = tokenizer.truncation_side
    tokenizer.truncation_side = "left"
    try:
        ids = tokenizer(text, add_special_tokens=add_special_tokens, truncation=True, max_length=max_tokens)
    finally:
        tokenizer.truncation_side = previous
    return list(ids["input_ids"])[-max_tokens:]  # when max_tokens is below the special tokens' count


def vocab_size(tokenizer: Any) -> int:
    """Ids below this are valid input (base vocabulary plus added tokens)."""
    return len(tokenizer)
