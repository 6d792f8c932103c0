"""How large a chat template's string-growing operation would be, known before it runs (frontend/chat_template.py).

Each function returns an upper bound, in characters (items for lists), of what the operation would build, computed
from its operands without building it: the sandbox refuses the operation when the bound passes the render's limit,
so a hostile template never allocates more than the limit at once. Iterables are walked one item at a time and the
walk stops as soon as the total passes the limit (`materialize`), so a lazy `map` of large items is never held whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sized
from typing import Any

# a printf conversion: %[(key)][flags][width][.precision][length]type
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")
_NUMBER = re.compile(r"\d+")
NUMBER_CHARS = 32  # a float or an int of at most MAX_INT_BITS (chat_template.py) in its shortest form, with room


class TooLarge(Exception):
    """The operation would build more than the limit; `size` is how much (or a lower bound of it)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def value_chars(value: Any) -> int:
    """A bound of `str(value)`'s length, for the operands these operations take."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (int, float, bool)) or value is None:
        return NUMBER_CHARS
    return len(str(value))  # a container already built: its text is proportional to it


def materialize(items: Iterable[Any], limit: int, separator_chars: int = 0) -> list[Any]:
    """`items` as a list, raising TooLarge as soon as their text (plus a separator each) passes `limit`."""
    out: list[Any] = []
    total = 0
    for item in items:
        total += value_chars(item) + (separator_chars if out else 0)
        if total > limit:
            raise TooLarge(total)
        out.append(item)
    return out


def spec_numbers(spec: str) -> int:
    """The sum of the numbers in a format spec (width, precision): what they can add to a field."""
    return sum(int(n) for n in _NUMBER.findall(spec))


def printf_chars(fmt: str, args: Any) -> int:
    """A bound of `fmt % args`: the format, every spec's width and precision, every argument's text; a `*` width
    takes its value from the arguments, so every int argument counts then."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    total = len(fmt) + sum(value_chars(v) for v in values)
    for width, precision, _ in _PRINTF_SPEC.findall(fmt):
        for number in (width, precision):
            if number == "*":
                total += sum(abs(v) for v in values if isinstance(v, int))
            elif number:
                total += int(number)
    return total


def binop_chars(operator: str, left: Any, right: Any) -> int | None:
    """A bound of `left <operator> right` when it can grow a string or list, else None."""
    if operator == "+" and isinstance(left, Sized) and isinstance(right, Sized):
        return len(left) + len(right)
    if operator == "*":
        size, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(size, Sized) and isinstance(count, int):
            return len(size) * max(count, 0)
    if operator == "%" and isinstance(left, str):
        return printf_chars(left, right)
    return None


def replace_chars(text: str, old: str, new: str, count: int | None = None) -> int:
    hits = len(text) + 1 if old == "" else text.count(old)
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def str_method_chars(text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """A bound of `text.<name>(*args, **kwargs)` for the str methods that grow text, else None."""
    if name in ("ljust", "rjust", "center", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        return max(len(text), width) if isinstance(width, int) else None
    if name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        return len(text) + text.count("\t") * max(size, 0) if isinstance(size, int) else None
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = args[2] if len(args) > 2 else kwargs.get("count")
        return replace_chars(text, args[0], args[1], count if isinstance(count, int) else None)
    return None


def json_depth(value: Any) -> int:
    """How deep lists and dicts nest in `value` (iteratively: a deep value must not exhaust the stack)."""
    depth, level = 0, [value]
    while level:
        level = [
            child
            for v in level
            if isinstance(v, (list, tuple, dict))
            for child in (v.values() if isinstance(v, dict) else v)
        ]
        depth += 1 if level else 0
    return depth


def tojson_chars(value: Any, indent: Any) -> int | None:
    """A bound of `tojson(value, indent=indent)`: the compact text, plus at most one indented line per character."""
    if not isinstance(indent, (int, str)) or not indent:
        return None
    compact = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    width = indent if isinstance(indent, int) else len(indent)
    return len(compact) * (2 + width * json_depth(value))


def escape_chars(text: str) -> int:
    """A bound of HTML-escaping `text` (`&`, `<`, `>`, `'`, `"` become entities of up to 5 characters)."""
    return len(text) + 4 * sum(text.count(c) for c in "&<>'\"")


def filter_chars(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """A bound of what the Jinja filter `name` builds from `args` (its value first) and `kwargs`, for the filters
    that can build more than they are given; None for the rest (their output is checked after)."""
    if not args:
        return None
    value, rest = args[0], args[1:]

    def arg(index: int, key: str, default: Any) -> Any:
        return rest[index] if len(rest) > index else kwargs.get(key, default)

    if name == "format" and isinstance(value, str):
        return printf_chars(value, kwargs or tuple(rest))
    if name == "replace" and isinstance(arg(0, "old", None), str) and isinstance(arg(1, "new", None), str):
        count = arg(2, "count", None)
        return replace_chars(
            str(value), arg(0, "old", ""), arg(1, "new", ""), count if isinstance(count, int) else None
        )
    if name == "indent":
        width, text = arg(0, "width", 4), str(value)
        return len(text) + (text.count("\n") + 1) * (width if isinstance(width, int) else len(str(width)))
    if name == "center":
        width = arg(0, "width", 80)
        return max(value_chars(value), width) if isinstance(width, int) else None
    if name == "wordwrap":
        width, wrap = arg(0, "width", 79), arg(2, "wrapstring", None)
        lines = value_chars(value) // max(width, 1) + 1 if isinstance(width, int) else value_chars(value)
        return value_chars(value) + lines * len(str(wrap or "\n"))
    if name in ("escape", "e", "forceescape"):
        return escape_chars(str(value))
    if name == "urlencode" and isinstance(value, str):
        return 12 * len(value)  # a 4-byte UTF-8 character is 12 characters of %XX
    if name == "tojson":
        return tojson_chars(value, arg(1, "indent", None))
    return None
