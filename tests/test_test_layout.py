"""The tests' own layout: helpers live in tests/helpers/ and are imported one way; no test module imports another."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

TESTS = Path(__file__).parent
HELPERS = {path.stem for path in (TESTS / "helpers").glob("*.py")} - {"__init__"}


def imported_modules(path: Path) -> Iterator[str]:
    """Every module a file imports, absolute (`from . import x` counts as the package's `x`)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            yield from (f"{base}.{alias.name}".lstrip(".") for alias in node.names)
            if base:
                yield base


TEST_MODULES = {path.stem for path in TESTS.rglob("test_*.py")}


def is_test_module(module: str) -> bool:
    """`tests.<room>.test_x`, or a bare `test_x` that pytest's sys.path makes importable."""
    return module.startswith("tests.") and module.rsplit(".", 1)[-1] in TEST_MODULES or module in TEST_MODULES


def is_helper_imported_another_way(module: str) -> bool:
    """A helper as a bare name (`sched_testing`) or from an old place (`tests.helpers.sched_testing`)."""
    parts = module.split(".")
    if module in HELPERS:
        return True
    return parts[0] == "tests" and parts[-1] in HELPERS and parts[:-1] != ["tests", "helpers"]


def offenders(rule: Callable[[str], bool]) -> list[str]:
    return [
        f"{path.relative_to(TESTS)} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module in imported_modules(path)
        if rule(module)
    ]


def test_no_test_module_imports_another() -> None:
    assert not offenders(is_test_module)


def test_helpers_are_imported_from_tests_helpers_only() -> None:
    """`from sched_testing import ...` (found through pytest's sys.path) and `tests.helpers.sched_testing` would be
    two modules with two copies of every global; only the second form is allowed."""
    assert not offenders(is_helper_imported_another_way)
