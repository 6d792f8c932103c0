"""The read loops scripts/bench_gguf_gemv.py takes its bandwidth bound from (`tm_gguf_read_sum`, kernels/gguf_cpu.cpp):
whatever the loads, the number of streams read side by side and the prefetch distance, each must read every byte of
the buffer exactly once, so its 64-bit lane sum equals numpy's sum of the buffer as uint64 words."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.gguf_kernels import needs_kernels
from tokenmill.kernels import gguf_ops


@needs_kernels
@pytest.mark.parametrize("streams", [1, 2, 4, 8])
@pytest.mark.parametrize("prefetch", [0, 512])
def test_every_read_loop_sums_every_byte_once(streams, prefetch):
    lib = gguf_ops.library()
    rng = np.random.default_rng(streams)
    buffer = rng.integers(0, 256, size=64 * 8 * 37, dtype=np.uint8)  # 37 lines per stream at 8 streams
    expected = int(buffer.view(np.uint64).sum(dtype=np.uint64))
    for isa in gguf_ops.available_isas():
        code = gguf_ops.ISA_CODES[isa]
        assert lib.tm_gguf_read_sum(code, buffer.ctypes.data, buffer.nbytes, streams, prefetch) == expected, isa
    assert lib.tm_gguf_stream_sum(buffer.ctypes.data, buffer.nbytes) == expected


@needs_kernels
def test_an_unsupported_isa_reads_nothing():
    lib = gguf_ops.library()
    buffer = np.ones(64, dtype=np.uint8)
    missing = [code for name, code in gguf_ops.ISA_CODES.items() if name not in gguf_ops.available_isas()]
    for code in missing:
        assert lib.tm_gguf_read_sum(code, buffer.ctypes.data, buffer.nbytes, 1, 0) == 0
