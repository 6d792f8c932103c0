"""The C++ CPU kernels' tests keep their tensors on the CPU on a machine with a GPU (conftest.py's device rule).

On the first device run (2026-11-27) this folder's conftest made CUDA the default device for every test, the C++
kernels' ones included: test_call_replay handed CUDA pointers to CPU kernels, failed, and pytest died of SIGSEGV,
losing every later test. Since then only Triton tests get the GPU: test_kernel_* modules, less the tests marked
cpu_kernel. These tests hold that rule where it can be checked without a GPU.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

CPU_KERNEL_MODULES = ("cpu_ops", "gguf_ops", "lora_cpu", "row_ops", "call_replay")


def _marked_cpu_kernel(function: ast.FunctionDef) -> bool:
    return any("cpu_kernel" in ast.unparse(decorator) for decorator in function.decorator_list)


def _calls_cpu_kernels(function: ast.FunctionDef) -> bool:
    return any(
        isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in CPU_KERNEL_MODULES
        for node in ast.walk(function)
    )


def test_a_cpu_kernel_module_keeps_the_cpu_as_default_device():
    assert torch.empty(1).device.type == "cpu"


def test_every_cpu_kernel_test_in_a_triton_module_is_marked():
    unmarked = []
    for path in sorted(Path(__file__).parent.glob("test_kernel_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                if _calls_cpu_kernels(node) and not _marked_cpu_kernel(node):
                    unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, f"mark these @pytest.mark.cpu_kernel (they call the C++ CPU kernels): {unmarked}"


def _bare_generators(node: ast.AST) -> list[ast.Call]:
    return [
        call
        for call in ast.walk(node)
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "torch.Generator" and not call.args
    ]


def test_triton_tests_draw_random_numbers_where_their_tensors_live():
    """The second device run (2026-11-27): a CPU generator fed randn/randint whose default device was CUDA ("Expected
    a 'cuda' device type for generator"); a bare torch.Generator() belongs only under `with torch.device("cpu")`."""
    misplaced = []
    for path in sorted(Path(__file__).parent.glob("test_kernel_*.py")):
        tree = ast.parse(path.read_text())
        on_cpu = {
            id(call)
            for block in ast.walk(tree)
            if isinstance(block, ast.With) and any(ast.unparse(i) == "torch.device('cpu')" for i in block.items)
            for call in _bare_generators(block)
        }
        misplaced += [f"{path.name}:{call.lineno}" for call in _bare_generators(tree) if id(call) not in on_cpu]
    assert not misplaced, f"use torch.Generator(torch.get_default_device()) or build on the CPU: {misplaced}"
