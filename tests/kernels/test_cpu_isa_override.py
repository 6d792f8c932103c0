"""`TOKENMILL_CPU_ISA=avx2` on an x86 machine with AVX-512: the small CPU kernels (`kernels/cpu_ops.py`) are built
without AVX-512, as on an AVX2 machine, into a library of their own, like the GGUF kernels switch versions."""

from __future__ import annotations

import platform

import pytest

from tokenmill.kernels import cpu_ops

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 only")


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_a_lower_isa_builds_without_avx512(monkeypatch, isa):
    default_name = cpu_ops.library_name("g++")
    monkeypatch.setenv("TOKENMILL_CPU_ISA", isa)
    assert cpu_ops.native_flags() == (*cpu_ops.FLAGS, "-mno-avx512f")
    assert cpu_ops.library_name("g++") != default_name  # never the AVX-512 build from the cache


@pytest.mark.parametrize("isa", [None, "avx512"])
def test_otherwise_the_native_build(monkeypatch, isa):
    if isa is None:
        monkeypatch.delenv("TOKENMILL_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("TOKENMILL_CPU_ISA", isa)
    assert cpu_ops.native_flags() == cpu_ops.FLAGS
