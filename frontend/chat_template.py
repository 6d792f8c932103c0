"""Chat templates rendered in a bounded Jinja sandbox.

A template is compiled once into jinja2's `ImmutableSandboxedEnvironment`, as transformers compiles it (same globals:
`raise_exception`, `strftime_now`, `namespace`, `dict`, the non-escaping `tojson`; `{% generation %}` renders its
body), so `''.__class__.__mro__` and friends raise `SecurityError`. A render is bounded in time and size, whatever the
template does:

- time: while a render runs, its thread traces the lines of the compiled template code (and nothing else), so every
  statement and every loop iteration checks the deadline; a template that loops forever stops at it;
- size: the output is streamed (`Template.generate`) and counted; `*` and `**` are checked before they compute, and
  the strings, lists and ints that calls, filters, attribute lookups and `namespace` assignments produce are checked
  after; anything past `max_chars` (or an int past `MAX_INT_BITS`) stops the render.

Either limit raises `RenderLimitError` (a jinja2 `TemplateError`). `variables` are the names the template reads that
the renderer does not set itself: the keys `chat_template_kwargs` may give (e.g. `enable_thinking`).
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from collections.abc import Sized
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from tokenmill.config import ServerConfig

# what the renderer passes itself (and transformers' apply_chat_template arguments): never a chat_template_kwargs key
RENDERER_ARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                           "chat_template", "tokenize", "return_dict", "return_assistant_tokens_mask", "padding",
                           "truncation", "max_length", "return_tensors", "tokenizer_kwargs",
                           "sanitize_control_tokens", "conversation"})
MAX_INT_BITS = 4096
TEMPLATE_FILENAME = "<template>"  # the file name Jinja gives the code it compiles from a string
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class RenderLimitError(jinja2.TemplateError):
    """A render ran past its time or size limit."""


@dataclass(frozen=True)
class RenderLimits:
    timeout_s: float
    max_chars: int

    @classmethod
    def of(cls, server: ServerConfig) -> "RenderLimits":
        return cls(server.chat_template_timeout_s, server.max_chat_template_chars)


DEFAULT_LIMITS = RenderLimits.of(ServerConfig())


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant tokens): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the size checks; the current render's limits live in a thread-local (renders run in threads)."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
        self._render = threading.local()
        self.filters = {name: self._guarded_filter(f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._guarded_filter(_tojson)
        sandbox = self

        class BoundedNamespace(Namespace):
            """`namespace()`: no underscore attributes (as transformers), and every value stored is size-checked."""

            def __setitem__(self, name: str, value: Any) -> None:
                if isinstance(name, str) and name.startswith("_"):
                    raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")
                super().__setitem__(name, sandbox.checked(value))

        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=BoundedNamespace,
                            dict=_TemplateDict())

    # ------------------------------------------------------------------ limits of the current render

    @property
    def max_chars(self) -> int:
        return getattr(self._render, "limits", DEFAULT_LIMITS).max_chars  # the defaults outside a render

    def checked(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_chars:
            raise RenderLimitError(f"the chat template built a value of {len(value)} items or characters "
                                   f"(limit {self.max_chars})")
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise RenderLimitError(f"the chat template built an integer of more than {MAX_INT_BITS} bits")
        return value

    def _guarded_filter(self, f):
        @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
        def guarded(*args, **kwargs):
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, int) and abs(arg) > self.max_chars:
                    raise RenderLimitError(f"the chat template passed {arg} to the filter {f.__name__!r}")
            return self.checked(f(*args, **kwargs))
        return guarded

    # ------------------------------------------------------------------ the sandbox's hooks

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        for arg in (*args, *kwargs.values()):
            __self.checked(arg)
        return __self.checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        return self.checked(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        return self.checked(super().getitem(obj, argument))

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            size, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(size, Sized) and isinstance(count, int) and len(size) * count > self.max_chars:
                raise RenderLimitError(f"the chat template repeated a value {count} times (limit "
                                       f"{self.max_chars} characters)")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
                raise RenderLimitError(f"the chat template raised an integer to the power {right}")
        return self.checked(super().call_binop(context, operator, left, right))

    # ------------------------------------------------------------------ rendering

    def render(self, template: jinja2.Template, context: dict[str, Any], limits: RenderLimits) -> str:
        """The template's output; RenderLimitError past the limits. Runs in the caller's thread."""
        deadline = time.monotonic() + limits.timeout_s

        def line_check(frame, event, arg):
            if time.monotonic() > deadline:
                raise RenderLimitError(f"the chat template took longer than {limits.timeout_s:g} s to render")
            return line_check

        def trace_template_code(frame, event, arg):
            return line_check if frame.f_code.co_filename == TEMPLATE_FILENAME else None

        self._render.limits = limits
        previous_trace = sys.gettrace()
        sys.settrace(trace_template_code)
        try:
            pieces: list[str] = []
            size = 0
            for piece in template.generate(**context):
                size += len(piece)
                if size > limits.max_chars:
                    raise RenderLimitError(f"the chat template rendered more than {limits.max_chars} characters")
                pieces.append(piece)
            return "".join(pieces)
        finally:
            sys.settrace(previous_trace)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain json.dumps, no HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """`dict(...)` in templates without exposing the dict type itself (as transformers)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)


_SANDBOX = BoundedSandbox()


class ChatTemplate:
    """One compiled chat template. `render` may run in any thread (renders of one template can overlap)."""

    def __init__(self, source: str) -> None:
        self.template = _SANDBOX.from_string(source)
        # the names it reads that nothing else sets (the special tokens are set too, but are known only per render)
        read = jinja2.meta.find_undeclared_variables(_SANDBOX.parse(source))
        self.variables = frozenset(read - RENDERER_ARGS - set(_SANDBOX.globals))

    def refused_kwargs(self, kwargs: dict[str, Any], special_tokens: dict[str, Any]) -> list[str]:
        """The keys of `kwargs` the template does not read, or that the renderer sets itself."""
        return [key for key in kwargs if key not in self.variables or key in special_tokens]

    def render(self, messages: list[dict[str, Any]], *, limits: RenderLimits, special_tokens: dict[str, Any],
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text. Raises jinja2.TemplateError (RenderLimitError past the limits, SecurityError for what
        the sandbox refuses), ValueError when the final message cannot be continued, or whatever the template's own
        code raises."""
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a final message with text content")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}]
        context = {**special_tokens, **(kwargs or {}), "messages": messages, "tools": tools, "documents": None,
                   "add_generation_prompt": add_generation_prompt and not continue_final_message}
        text = _SANDBOX.render(self.template, context, limits)
        if not continue_final_message:
            return text
        at = text.rfind(CONTINUE_TAG.strip())
        if at < 0:
            raise ValueError("continue_final_message is set but the chat template dropped the final message")
        # the template may strip the message's trailing space (and the tag's with it)
        return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> ChatTemplate:
    """The compiled template (the server's, or a request's with --trust-request-chat-template), cached by source.
    Raises jinja2.TemplateSyntaxError for a template that does not parse."""
    return ChatTemplate(source)
