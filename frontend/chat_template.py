"""Chat templates rendered in a bounded Jinja sandbox.

A template is compiled once into jinja2's `ImmutableSandboxedEnvironment`, as transformers compiles it (same globals:
`raise_exception`, `strftime_now`, `namespace`, `dict`, the non-escaping `tojson`; `{% generation %}` renders its
body), so `''.__class__.__mro__` and friends raise `SecurityError`. A render is bounded in time and size, whatever the
template does:

- time: while a render runs, its thread traces the lines of the compiled template code (and nothing else), so every
  statement and every loop iteration checks the deadline; a template that loops forever stops at it;
- size: the output is streamed (`Template.generate`) and counted; every operation that can build a larger string or
  list than it is given is checked before it builds anything (frontend/template_sizes.py): the operators `+`, `~`,
  `*`, `%`, `**`, the str methods `ljust`, `rjust`, `center`, `zfill`, `expandtabs`, `replace`, `join`, `format`,
  `format_map`, and the filters that grow text (`format`, `join`, `replace`, `indent`, `center`, `wordwrap`, `escape`,
  `urlencode`, `tojson` with an indent); the strings, lists and ints that calls, filters, attribute lookups and
  `namespace` assignments produce are checked after as well; anything past `max_chars` (or an int past
  `MAX_INT_BITS`) stops the render;
- compile time: Jinja folds constant expressions while it compiles, outside any render; those operators and every
  filter are kept from folding (they run at render time, under the limits), so `{{ "%0400000000d" % 1 }}` costs
  nothing to compile; and a request's own template compiles within the render's time limit (`compile_within`).

The compiled templates are cached by source, up to `TEMPLATE_CACHE_CHARS` of source in all.

Either limit raises `RenderLimitError` (a jinja2 `TemplateError`). `variables` are the names the template reads that
the renderer does not set itself: the keys `chat_template_kwargs` may give (e.g. `enable_thinking`).
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import threading
import time
import types
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace, generate_lorem_ipsum, pass_context
from markupsafe import Markup

from tokenmill.config import ServerConfig
from tokenmill.frontend.template_sizes import (
    TooLarge,
    binop_chars,
    filter_chars,
    materialize,
    spec_numbers,
    str_method_chars,
    value_chars,
)

# what the renderer passes itself (and transformers' apply_chat_template arguments): never a chat_template_kwargs key
RENDERER_ARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "return_dict",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
        "conversation",
    }
)
MAX_INT_BITS = 4096
LIPSUM_WORD_CHARS = 16  # the longest lorem-ipsum word with its space and punctuation
LIPSUM_PARAGRAPH_CHARS = 16  # <p>, </p>, newlines
TEMPLATE_FILENAME = "<template>"  # the file name Jinja gives the code it compiles from a string
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class RenderLimitError(jinja2.TemplateError):
    """A render ran past its time or size limit."""


@dataclass(frozen=True)
class RenderLimits:
    timeout_s: float
    max_chars: int

    @classmethod
    def of(cls, server: ServerConfig) -> RenderLimits:
        return cls(server.chat_template_timeout_s, server.max_chat_template_chars)


DEFAULT_LIMITS = RenderLimits.of(ServerConfig())


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant tokens): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _BoundedFields:
    """`str.format`'s formatter, checking each field's width and precision (and the text so far) before it formats
    the field."""

    def __init__(self, *args: Any, limit: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limit = limit
        self._total = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._total = len(format_string)
        return super().vformat(format_string, args, kwargs)  # type: ignore[misc]

    def format_field(self, value: Any, format_spec: str) -> str:
        if self._total + spec_numbers(format_spec) + value_chars(value) > self._limit:
            raise RenderLimitError(f"the chat template's str.format would build more than {self._limit} characters")
        text: str = super().format_field(value, format_spec)  # type: ignore[misc]
        self._total += len(text)
        return text


class _BoundedFormatter(_BoundedFields, SandboxedFormatter):
    pass


class _BoundedEscapeFormatter(_BoundedFields, SandboxedEscapeFormatter):
    pass


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's compiler, with `~` (concatenation) through the sandbox's size check."""

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the size checks; the current render's limits live in a thread-local (renders run in threads)."""

    # checked before they compute (call_binop), and therefore never folded at compile time (BinExpr.as_const)
    intercepted_binops = frozenset({"+", "*", "%", "**"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
        self._render = threading.local()
        self.filters = {name: self._guarded_filter(name, f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._guarded_filter("tojson", _tojson)
        sandbox = self

        class BoundedNamespace(Namespace):
            """`namespace()`: no underscore attributes (as transformers), and every value stored is size-checked."""

            def __setitem__(self, name: str, value: Any) -> None:
                if isinstance(name, str) and name.startswith("_"):
                    raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")
                super().__setitem__(name, sandbox.checked(value))

        def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
            """Jinja's `lipsum()`, its size checked first (a paragraph is at most `max` words)."""
            sandbox.refuse_past_limit(n * (max * LIPSUM_WORD_CHARS + LIPSUM_PARAGRAPH_CHARS), "lipsum()")
            return generate_lorem_ipsum(n, html, min, max)

        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            namespace=BoundedNamespace,
            dict=_TemplateDict(),
            lipsum=lipsum,
        )

    # ------------------------------------------------------------------ limits of the current render

    @property
    def max_chars(self) -> int:
        return getattr(self._render, "limits", DEFAULT_LIMITS).max_chars  # the defaults outside a render

    def checked(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_chars:
            raise RenderLimitError(
                f"the chat template built a value of {len(value)} items or characters (limit {self.max_chars})"
            )
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise RenderLimitError(f"the chat template built an integer of more than {MAX_INT_BITS} bits")
        return value

    def refuse_past_limit(self, size: int | None, what: str) -> None:
        """RenderLimitError when an operation would build `size` characters or items, more than the limit."""
        if size is not None and size > self.max_chars:
            raise RenderLimitError(
                f"the chat template's {what} would build {size} characters or items (limit {self.max_chars})"
            )

    def bounded_list(self, items: Any, separator_chars: int, what: str) -> list[Any]:
        """`items` walked into a list, stopping past the limit (what `join` would build)."""
        try:
            return materialize(items, self.max_chars, separator_chars)
        except TooLarge as exc:
            raise RenderLimitError(
                f"the chat template's {what} would build {exc.size} characters or more (limit {self.max_chars})"
            ) from None

    def bounded_concat(self, values: tuple[Any, ...]) -> str:
        """`a ~ b ~ ...`, its size checked before it is joined."""
        parts = [v if isinstance(v, str) else str(v) for v in values]
        self.refuse_past_limit(sum(len(p) for p in parts), "operator '~'")
        return "".join(parts)

    def _guarded_filter(self, name: str, f: Any) -> Any:
        """`f` checked before it runs (its size arguments, and what it would build) and after. Marked pass_context,
        which also keeps Jinja from running it at compile time (constant folding), outside any render's limits."""
        lead = getattr(getattr(f, "jinja_pass_arg", None), "name", "")

        @functools.wraps(f)
        def guarded(context: Any, *args: Any, **kwargs: Any) -> Any:
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, int) and abs(arg) > self.max_chars:
                    raise RenderLimitError(f"the chat template passed {arg} to the filter {name!r}")
            if name == "join" and args:
                separator = args[1] if len(args) > 1 else kwargs.get("d", "")
                args = (self.bounded_list(args[0], len(str(separator)), "filter 'join'"), *args[1:])
            self.refuse_past_limit(filter_chars(name, args, kwargs), f"filter {name!r}")
            first = {
                "context": (context,),
                "eval_context": (context.eval_ctx,),
                "environment": (context.environment,),
            }.get(lead, ())
            return self.checked(f(*first, *args, **kwargs))

        return pass_context(guarded)

    # ------------------------------------------------------------------ the sandbox's hooks

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        for arg in (*args, *kwargs.values()):
            __self.checked(arg)
        text = getattr(__obj, "__self__", None)
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(text, str):  # a str method: check it first
            if __obj.__name__ == "join" and args:
                args = (__self.bounded_list(args[0], len(text), "str.join"), *args[1:])
            __self.refuse_past_limit(str_method_chars(text, __obj.__name__, args, kwargs), f"str.{__obj.__name__}")
        return __self.checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        return self.checked(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        return self.checked(super().getitem(obj, argument))

    def wrap_str_format(self, value: Any) -> Any:
        """`str.format` / `str.format_map` as jinja's sandbox wraps them, through a formatter that checks each field
        before formatting it."""
        if (
            not isinstance(value, (types.MethodType, types.BuiltinMethodType))
            or value.__name__ not in ("format", "format_map")
            or not isinstance(value.__self__, str)
        ):
            return None
        text: str = value.__self__
        formatter: _BoundedFields = (
            _BoundedEscapeFormatter(self, escape=text.escape, limit=self.max_chars)
            if isinstance(text, Markup)
            else _BoundedFormatter(self, limit=self.max_chars)
        )
        is_format_map = value.__name__ == "format_map"

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            if not is_format_map:
                return type(text)(formatter.vformat(text, args, kwargs))
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one mapping argument")
            return type(text)(formatter.vformat(text, (), args[0]))

        return functools.update_wrapper(bounded_format, value)

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
                raise RenderLimitError(f"the chat template raised an integer to the power {right}")
        else:
            self.refuse_past_limit(binop_chars(operator, left, right), f"operator {operator!r}")
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


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
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

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        limits: RenderLimits,
        special_tokens: dict[str, Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text. Raises jinja2.TemplateError (RenderLimitError past the limits, SecurityError for what
        the sandbox refuses), ValueError when the final message cannot be continued, or whatever the template's own
        code raises."""
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a final message with text content")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}]
        context = {
            **special_tokens,
            **(kwargs or {}),
            "messages": messages,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
        }
        text = _SANDBOX.render(self.template, context, limits)
        if not continue_final_message:
            return text
        at = text.rfind(CONTINUE_TAG.strip())
        if at < 0:
            raise ValueError("continue_final_message is set but the chat template dropped the final message")
        # the template may strip the message's trailing space (and the tag's with it)
        return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


class TemplateCache:
    """Compiled templates by source, least recently used out first, bounded by their sources' total size (a
    template's compiled code is a small multiple of its source); a source larger than the bound is never cached."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # renders, and so compiles, run on several threads

    def get(self, source: str, timeout_s: float | None = None) -> ChatTemplate:
        """The compiled template; a miss compiles it (within `timeout_s`, when given: `compile_within`)."""
        with self._lock:
            template = self._templates.get(source)
            if template is not None:
                self._templates.move_to_end(source)
                return template
        template = ChatTemplate(source) if timeout_s is None else compile_within(source, timeout_s)
        if len(source) <= self.max_chars:
            with self._lock:
                if source not in self._templates:
                    self._templates[source] = template
                    self._chars += len(source)
                while self._chars > self.max_chars:
                    evicted, _ = self._templates.popitem(last=False)
                    self._chars -= len(evicted)
        return template

    @property
    def chars(self) -> int:
        return self._chars


TEMPLATE_CACHE_CHARS = 4 << 20
_TEMPLATES = TemplateCache(TEMPLATE_CACHE_CHARS)


_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def compile_within(source: str, timeout_s: float) -> ChatTemplate:
    """`ChatTemplate(source)`, or RenderLimitError past `timeout_s`: compiling is linear in the source but slow (tens
    of seconds for a few MB), so a request's template is compiled under the render deadline. Every Python call made
    while compiling checks it (call events only: no per-line tracing)."""
    deadline = time.monotonic() + timeout_s

    def check_deadline(frame: Any, event: str, arg: Any) -> None:
        # never from a generator's frame: an error raised while a generator is being closed (jinja's lexer
        # generators, collected mid-compile) is only reported as unraisable, and a trace function that raised is
        # switched off, so the compile would run to its end unchecked; the next plain call raises instead
        if time.monotonic() > deadline and not frame.f_code.co_flags & _GENERATOR_FLAGS:
            raise RenderLimitError(f"the chat template took longer than {timeout_s:g} s to compile")

    def rearm(frame: Any, event: str, arg: Any) -> None:
        # Python switches a trace function off once it raised; where that error was swallowed (an `except Exception`
        # on the way up, a generator's finalizer) the compile would go on unchecked, so the profile hook, which never
        # raises, puts the check back: the next call raises again
        if sys.gettrace() is None:
            sys.settrace(check_deadline)

    previous_trace, previous_profile = sys.gettrace(), sys.getprofile()
    sys.settrace(check_deadline)
    sys.setprofile(rearm)
    try:
        template = ChatTemplate(source)
    finally:
        sys.setprofile(previous_profile)
        sys.settrace(previous_trace)
    # the trace function's error can be swallowed (raised while jinja's lexer generators are being closed, Python
    # only reports it as unraisable), so the deadline is checked once more on the way out
    if time.monotonic() > deadline:
        raise RenderLimitError(f"the chat template took longer than {timeout_s:g} s to compile")
    return template


def compile_chat_template(source: str, timeout_s: float | None = None) -> ChatTemplate:
    """The compiled template (the server's, or a request's with --trust-request-chat-template, then compiled within
    `timeout_s`), cached by source. Raises jinja2.TemplateSyntaxError for a template that does not parse,
    RenderLimitError when it takes longer than `timeout_s` to compile."""
    return _TEMPLATES.get(source, timeout_s)
