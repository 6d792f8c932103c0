"""Running the CPU kernels of `kernels/cpu_ops.cpp` as each x86 ISA level builds them, on one machine.

`TOKENMILL_CPU_ISA=avx2` builds the kernels without AVX-512 (`cpu_ops.native_flags`), so an AVX-512 machine also
tests the AVX2 code paths: `use_cpu_kernels_built_for` points `cpu_ops`' wrappers at that build for one test.
"""

from __future__ import annotations

import platform

import pytest

from tokenmill.kernels import cpu_ops

# "native": the library the worker loads here; "avx2": built as on an AVX2 machine (x86 only)
CPU_ISAS = ["native", "avx2"]


def use_cpu_kernels_built_for(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Make `cpu_ops`' wrappers call the kernels as `isa` builds them, until `monkeypatch` undoes it."""
    if isa == "native":
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"TOKENMILL_CPU_ISA={isa} selects an x86 build")
    monkeypatch.setenv("TOKENMILL_CPU_ISA", isa)
    lib = cpu_ops.library_built_with(cpu_ops.native_flags())
    monkeypatch.setattr(cpu_ops, "library", lambda: lib)
