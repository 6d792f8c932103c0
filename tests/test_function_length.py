"""Every function in workers/ fits on a screen: at most MAX_LINES lines, docstring and decorators included."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 60
WORKERS = Path(__file__).resolve().parent.parent / "workers"


def long_functions(root: Path, max_lines: int) -> list[str]:
    """`path:line name (n lines)` for every function or method under `root` longer than `max_lines`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                if length > max_lines:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_workers_is_longer_than_a_screen():
    assert long_functions(WORKERS, MAX_LINES) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path, MAX_LINES) == [f"{tmp_path.name}/long.py:1 long ({MAX_LINES + 1} lines)"]
