"""Chat templates under hostile and careless requests: only the server's template unless trusted, kwargs limited to
the template's variables, the sandbox, time and size bounds, and tokenization off the event loop."""

from __future__ import annotations

import asyncio
import copy
import time

from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tokenmill.config import replace
from tokenmill.frontend.tokenizer import encode_text

HI = [{"role": "user", "content": "Hi"}]
THINKING_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking %}<think>{% endif %}{% endif %}"
)


def with_template(tokenizer, template: str):
    """The session tokenizer with another chat template (as --chat-template gives it)."""
    custom = copy.copy(tokenizer)
    custom.chat_template = template
    return custom


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


@async_test
async def test_request_chat_template_needs_the_trust_flag(smollm2_model, tokenizer):
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    async with serving(smollm2_model, tokenizer) as h:
        status, body, _ = await h.post("/v1/chat/completions", chat(chat_template=own))
        assert_error(status, body, 400, "BadRequestError", "chat_template")
        assert "--trust-request-chat-template" in body["error"]["message"] and h.engine.requests == []
    async with serving(smollm2_model, tokenizer, trust_request_chat_template=True) as h:
        status, body, _ = await h.post("/v1/chat/completions", chat(chat_template=own))
        assert status == 200, body
        assert h.engine.requests[0].prompt_token_ids == encode_text(tokenizer, "[Hi]", add_special_tokens=False)
        status, body, _ = await h.post("/v1/chat/completions", chat(chat_template="{{ ''.__class__.__mro__ }}"))
        assert_error(status, body, 400, "BadRequestError", "chat_template")
        status, body, _ = await h.post("/v1/chat/completions", chat(chat_template="{% for %}"))
        assert_error(status, body, 400, "BadRequestError", "chat_template")
        assert "does not parse" in body["error"]["message"]


@async_test
async def test_chat_template_kwargs_only_set_the_templates_own_variables(smollm2_model, tokenizer):
    async with serving(smollm2_model, with_template(tokenizer, THINKING_TEMPLATE)) as h:
        status, body, _ = await h.post("/v1/chat/completions", chat(chat_template_kwargs={"enable_thinking": True}))
        assert status == 200, body
        expected = encode_text(tokenizer, "<user>Hi<assistant><think>", add_special_tokens=False)
        assert h.engine.requests[0].prompt_token_ids == expected
        # the renderer's own arguments (a TypeError -> 500 before), special tokens, and names the template never reads
        for key in ("tokenize", "add_generation_prompt", "messages", "chat_template", "bos_token", "temperature"):
            status, body, _ = await h.post("/v1/chat/completions", chat(chat_template_kwargs={key: True}))
            assert_error(status, body, 400, "BadRequestError", f"chat_template_kwargs.{key}")
            assert key in body["error"]["message"]
        status, body, _ = await h.post("/tokenize", {"messages": HI, "chat_template_kwargs": {"tokenize": True}})
        assert_error(status, body, 400, "BadRequestError", "chat_template_kwargs.tokenize")
        await h.good_completion()


@async_test
async def test_a_template_escaping_the_sandbox_is_a_400(smollm2_model, tokenizer):
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    async with serving(smollm2_model, with_template(tokenizer, escape)) as h:
        status, body, _ = await h.post("/v1/chat/completions", chat())
    assert_error(status, body, 400, "BadRequestError", "messages")
    assert "sandbox" in body["error"]["message"] and "__class__" in body["error"]["message"]


@async_test
async def test_a_template_that_runs_long_stops_at_the_timeout(smollm2_model, tokenizer):
    # ~10^10 loop iterations: hours without a bound; the trace of the template's lines stops it at the deadline
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages }}"
    async with serving(smollm2_model, with_template(tokenizer, slow), chat_template_timeout_s=0.3) as h:
        start = time.monotonic()
        status, body, _ = await h.post("/v1/chat/completions", chat())
        elapsed = time.monotonic() - start
        assert_error(status, body, 400, "BadRequestError", "messages")
        assert "0.3 s" in body["error"]["message"] and elapsed < 5
        status, body, _ = await h.post("/tokenize", {"messages": HI})  # the same template, the same bound
        assert_error(status, body, 400, "BadRequestError", "messages")
        await h.good_completion()


@async_test
async def test_a_template_that_renders_too_much_stops_at_the_size_limit(smollm2_model, tokenizer):
    templates = [
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",  # output, streamed and counted
        "{{ ('ab' * 100000000)|length }}",  # one value, checked before it is built
        "{{ 'x'|center(1000000000) }}",  # a filter's size argument
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    ]
    for template in templates:
        async with serving(smollm2_model, with_template(tokenizer, template), max_chat_template_chars=100_000) as h:
            status, body, _ = await h.post("/v1/chat/completions", chat())
            assert_error(status, body, 400, "BadRequestError", "messages")
            assert "limit" in body["error"]["message"] or "100000" in body["error"]["message"], template


@async_test
async def test_a_huge_prompt_is_tokenized_off_the_event_loop(smollm2_model, tokenizer):
    """While a ~600k-token prompt is tokenized (then refused: too long), the event loop keeps running."""
    words = ("alpha", "river", "stone", "quantum", "mill", "token", "seven", "blue")
    text = " ".join(f"{words[i % 8]}{i % 997}" for i in range(150_000))
    start = time.perf_counter()
    encode_text(tokenizer, text, add_special_tokens=True)
    tokenize_s = time.perf_counter() - start
    async with serving(smollm2_model, tokenizer) as h:
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        for path, body in (
            ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}),
            ("/v1/chat/completions", chat(messages=[{"role": "user", "content": text}])),
        ):
            status, answer, _ = await h.post(path, body)
            assert_error(status, answer, 400, "BadRequestError")
            assert "maximum context length" in answer["error"]["message"]
        done.set()
        await ticking
    # the loop (server and client share it here) never waited for a whole tokenization
    assert max(gaps) < tokenize_s / 3, (max(gaps), tokenize_s)


@async_test
async def test_continue_final_message_and_tools_still_render(smollm2_model, tokenizer):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    async with serving(replace(smollm2_model), tokenizer) as h:
        status, body, _ = await h.post(
            "/v1/chat/completions", chat(messages=messages, add_generation_prompt=False, continue_final_message=True)
        )
        assert status == 200, body
        expected = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
        assert h.engine.requests[0].prompt_token_ids == encode_text(tokenizer, expected, add_special_tokens=False)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        status, body, _ = await h.post("/v1/chat/completions", chat(tools=tools, tool_choice="none"))
        assert status == 200, body
