"""Tokenizer loading (GGUF file, overrides) and chat templating, including template errors as 400s."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.helpers.frontend_fakes import FakeEngine
from tokenmill.config import EngineConfig, replace
from tokenmill.frontend.context import ServingContext
from tokenmill.frontend.errors import APIError
from tokenmill.frontend.protocol import ChatMessage
from tokenmill.frontend.serving_chat import chat_prompt_ids
from tokenmill.frontend.tokenizer import load_tokenizer, read_chat_template, render_chat

STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
    "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_read_chat_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(STRICT_TEMPLATE)
    assert read_chat_template(str(path)) == STRICT_TEMPLATE
    assert read_chat_template(STRICT_TEMPLATE) == STRICT_TEMPLATE
    with pytest.raises(ValueError):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_gguf_tokenizer_override_and_chat_template(smollm2_model, tokenizer, tmp_path):
    path = tmp_path / "strict.jinja"
    path.write_text(STRICT_TEMPLATE)
    gguf_path = os.path.join(smollm2_model.path, smollm2_model.gguf_file)
    model = replace(smollm2_model, path="/nonexistent", gguf_file=None, tokenizer=gguf_path, chat_template=str(path))
    custom = load_tokenizer(model)
    assert custom.encode("Hello world") == tokenizer.encode("Hello world")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    assert render_chat(custom, messages) == "[user] hi\n[assistant] Hel\n[assistant] "
    assert render_chat(custom, messages[:1], add_generation_prompt=False) == "[user] hi\n"

    ctx = ServingContext.create(EngineConfig(model=model), FakeEngine(), custom)
    with pytest.raises(APIError) as info:
        asyncio.run(chat_prompt_ids(ctx, [ChatMessage(role="system", content="x")]))
    assert info.value.status == 400 and info.value.param == "messages" and "no system role" in info.value.message
    custom.chat_template = None
    with pytest.raises(APIError) as info:
        asyncio.run(chat_prompt_ids(ctx, [ChatMessage(role="user", content="x")]))
    assert "no chat template" in info.value.message


def test_continue_final_message(tokenizer):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    text = render_chat(tokenizer, messages, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe color is")
