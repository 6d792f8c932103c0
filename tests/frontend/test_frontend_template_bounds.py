"""A trusted request's chat template is bounded before it allocates: every string-growing operation is refused from
its operands, constant folding at compile time builds nothing large, and the template cache is bounded in size."""

from __future__ import annotations

import time
import tracemalloc

import jinja2
import pytest

from tests.helpers.frontend_server import MODEL, assert_error, async_test, serving
from tokenmill.frontend import chat_template
from tokenmill.frontend.chat_template import (
    ChatTemplate,
    RenderLimitError,
    RenderLimits,
    TemplateCache,
    compile_chat_template,
)

LIMIT = 100_000
LIMITS = RenderLimits(timeout_s=5.0, max_chars=LIMIT)
BIG = 50_000_000  # what each hostile template asks for: 500x the limit
PEAK_BYTES = 4 << 20  # far below BIG: the operation was refused before it was built
HI = [{"role": "user", "content": "hi"}]
CHUNK = "{% set s = 'x' * 90000 %}"  # just under the limit: two of them are over it

HOSTILE = {
    "printf %": f"{{{{ '%0{BIG}d' % 1 }}}}",
    "printf % star width": f"{{{{ '%*d' % ({BIG}, 1) }}}}",
    "printf % precision": f"{{{{ '%.{BIG}f' % 1.5 }}}}",
    "str.format width": f"{{{{ '{{:>{BIG}}}'.format(1) }}}}",
    "str.format_map": f"{{{{ '{{a:>{BIG}}}'.format_map({{'a': 1}}) }}}}",
    "str.format many fields": "{{ ('{0:>90000}' * 2).format(1) }}",
    "str.ljust": f"{{{{ 'x'.ljust({BIG}) }}}}",
    "str.rjust": f"{{{{ 'x'.rjust({BIG}) }}}}",
    "str.center": f"{{{{ 'x'.center({BIG}) }}}}",
    "str.zfill": f"{{{{ '1'.zfill({BIG}) }}}}",
    "str.expandtabs": f"{{{{ '\\t\\t'.expandtabs({BIG}) }}}}",
    "str.join": CHUNK + "{{ ''.join([s] * 1 + [s]) }}",
    "str.join lazy": "{{ ''.join(range(1000)|map('string')|map('center', 90000)) }}",
    "str.replace": CHUNK + "{{ s.replace('x', 'xx') }}",
    "repeat *": f"{{{{ 'ab' * {BIG} }}}}",
    "concat ~": CHUNK + "{{ s ~ s }}",
    "plus +": CHUNK + "{{ s + s }}",
    "list +": CHUNK + "{{ (s|list) + (s|list) }}",
    "doubling in a loop": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "filter format": f"{{{{ '%0{BIG}d'|format(1) }}}}",
    "filter join": CHUNK + "{{ [s, s]|join }}",
    "filter replace": CHUNK + "{{ s|replace('x', 'xx') }}",
    "filter indent": "{{ ('a\\n' * 50000)|indent(1000) }}",
    "filter center": f"{{{{ 'x'|center({BIG}) }}}}",
    "filter wordwrap": CHUNK + "{{ s|wordwrap(1, true, '" + "y" * 100 + "') }}",
    "lipsum": f"{{{{ lipsum({BIG}) }}}}",
    "filter tojson indent": "{{ [[[[[[['x']]]]]]]|tojson(indent=90000) }}",
}


def peak_of(fn) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    error = None
    try:
        fn()
    except Exception as exc:  # what the test asserts on
        error = exc
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, error


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_growing_operation_is_refused_before_it_allocates(source):
    template = ChatTemplate(source)
    peak, error = peak_of(lambda: template.render(HI, limits=LIMITS, special_tokens={}))
    assert isinstance(error, RenderLimitError), error
    assert peak < PEAK_BYTES, f"{peak} bytes allocated"


@pytest.mark.parametrize(
    "source",
    [
        f"{{{{ '%0{BIG}d' % 1 }}}}",
        f"{{{{ 'x'|center({BIG}) }}}}",
        f"{{{{ 'ab' * {BIG} }}}}",
        f"{{{{ '%0{BIG}d'|format(1) }}}}",
        f"{{% set x = '%0{BIG}d' % 1 %}}{{{{ x|length }}}}",
    ],
)
def test_compiling_folds_nothing_large(source):
    peak, error = peak_of(lambda: ChatTemplate(source))
    assert error is None and peak < PEAK_BYTES, f"{peak} bytes allocated compiling {source}"


def test_ordinary_templates_still_render():
    source = (
        "{% for m in messages %}{{ '<|%s|>' % m.role }}{{ '{}: {}'.format(m.role, m.content) }}"
        "{{ (m.content ~ '!')|indent(2) }}{{ ['a', 'b']|join(', ') }}{{ 'x'.ljust(3) + '|' }}"
        "{{ {'k': [1, 2]}|tojson(indent=2) }}{{ '%05.1f'|format(2.5) }}{{ m.content.replace('h', 'H') }}"
        "{% endfor %}{{ (lipsum(2, html=false)|length > 0)|string }}"
    )
    text = ChatTemplate(source).render(HI, limits=LIMITS, special_tokens={})
    assert text == ('<|user|>user: hihi!a, bx  |{\n  "k": [\n    1,\n    2\n  ]\n}002.5HiTrue')


def test_the_sandbox_still_refuses_escapes_through_format():
    template = ChatTemplate("{{ '{0.__class__.__mro__}'.format(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        template.render(HI, limits=LIMITS, special_tokens={})


def test_template_cache_is_bounded_by_source_size():
    cache = TemplateCache(max_chars=1000)
    sources = [f"{{# {i} #}}" + "x" * 390 for i in range(4)]
    compiled = [cache.get(source) for source in sources]
    assert cache.chars <= 1000
    assert cache.get(sources[-1]) is compiled[-1]  # cached
    assert cache.get(sources[0]) is not compiled[0]  # evicted, compiled again
    huge = "y" * 2000
    assert cache.get(huge) is not cache.get(huge)  # larger than the whole cache: never kept
    assert cache.chars <= 1000


SLOW_TO_COMPILE = "{% for m in messages %}{{ m.content }}{% endfor %}" * 40_000  # 2 MB: about a minute to compile


def test_a_request_template_compiles_within_the_deadline():
    start = time.monotonic()
    with pytest.raises(RenderLimitError, match="compile"):
        compile_chat_template(SLOW_TO_COMPILE, timeout_s=0.3)
    assert time.monotonic() - start < 5


@async_test
async def test_a_template_too_slow_to_compile_is_a_400(smollm2_model, tokenizer):
    async with serving(smollm2_model, tokenizer, trust_request_chat_template=True, chat_template_timeout_s=0.3) as h:
        start = time.monotonic()
        status, body, _ = await h.post(
            "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2, "chat_template": SLOW_TO_COMPILE}
        )
        assert_error(status, body, 400, "BadRequestError", "chat_template")
        assert "compile" in body["error"]["message"] and time.monotonic() - start < 5
        await h.good_completion()


def test_a_deadline_passed_while_a_generator_closes_still_stops_the_compile(monkeypatch):
    """The deadline falls while a generator is being closed (as jinja's lexer generators are, mid-compile): an error
    raised there is only reported as unraisable and switches the trace function off, so the check must wait for the
    next plain call instead of letting the rest of the compile run unchecked."""
    calls_after_the_deadline = []

    def tokens():
        yield 1
        yield 2

    def parse_step():
        calls_after_the_deadline.append(1)

    class SlowCompile:
        def __init__(self, source):
            pending = tokens()
            next(pending)
            time.sleep(0.05)  # past the deadline, in C: no trace event
            del pending  # closed now: the first event after the deadline is the generator's
            for _ in range(1000):
                parse_step()

    monkeypatch.setattr(chat_template, "ChatTemplate", SlowCompile)
    with pytest.raises(RenderLimitError, match="compile"):
        chat_template.compile_within("{{ x }}", timeout_s=0.01)
    assert calls_after_the_deadline == []


def test_a_deadline_error_swallowed_by_the_compiler_is_raised_again(monkeypatch):
    """Code inside the compile that catches every exception swallows the deadline's error once, and Python switches
    a trace function off after it raised: the check must come back and stop the rest of the compile."""
    calls_after_the_swallow = []

    def parse_step():
        calls_after_the_swallow.append(1)

    class SwallowingCompile:
        def __init__(self, source):
            time.sleep(0.05)  # past the deadline, in C: no trace event
            try:
                parse_step()  # the deadline's error is raised here ...
            except Exception:
                calls_after_the_swallow.clear()  # ... and swallowed
            for _ in range(1000):
                parse_step()

    monkeypatch.setattr(chat_template, "ChatTemplate", SwallowingCompile)
    with pytest.raises(RenderLimitError, match="compile"):
        chat_template.compile_within("{{ x }}", timeout_s=0.01)
    assert len(calls_after_the_swallow) <= 1
