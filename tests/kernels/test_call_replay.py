"""The native replay loop of recorded kernel calls (`kernels/call_replay.py`): the same results as the ctypes calls it
replaces (integer arguments past the registers, float ones, null pointers), a refusing kernel named, per-call times,
and None for what it cannot lay out."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
import torch

from tokenmill.kernels import call_replay, cpu_ops
from tokenmill.workers.cpu_graphs import CpuCallCapture, recording_kernel_calls


@pytest.fixture(autouse=True)
def native_replay():
    if cpu_ops.library() is None or call_replay.library() is None:
        pytest.skip("no C++ compiler, or a platform without the native replay")


def _paged_inputs(rng: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoding sequence of 37 cached tokens in 3 scattered blocks, 6 query heads over 2 KV heads."""
    return {
        "query": torch.randn(1, 6, 64, generator=rng),
        "k_cache": torch.randn(8, 16, 2, 64, generator=rng),
        "v_cache": torch.randn(8, 16, 2, 64, generator=rng),
        "block_tables": torch.tensor([[5, 1, 7]], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 1], dtype=torch.int32),
        "seq_lens": torch.tensor([37], dtype=torch.int32),
    }


def _forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, paged: dict[str, torch.Tensor]):
    """Kernels whose arguments cover every class: 18 integer-class ones and 3 floats (attention), null pointers and
    a float (RMSNorm without a residual), and a few integers only (SiLU-and-mul)."""
    normed, _ = cpu_ops.rms_norm(x, weight, 1e-5)
    summed, residual_out = cpu_ops.rms_norm(x, weight, 1e-6, residual)
    gated = cpu_ops.silu_and_mul(x)
    out = torch.empty_like(paged["query"])
    cpu_ops.decode_attention(out, **paged, scale=0.125, sliding_window=20)
    return [normed, summed, residual_out, gated, out]


def test_native_replay_reproduces_the_ctypes_calls_bit_for_bit():
    rng = torch.Generator().manual_seed(0)
    x, residual, weight = torch.randn(3, 96, generator=rng), torch.randn(3, 96, generator=rng), torch.randn(96)
    paged = _paged_inputs(rng)
    calls: list = []
    with recording_kernel_calls(calls):
        outputs = _forward(x, residual, weight, paged)
    native = call_replay.NativeCalls.build(calls)
    assert native is not None and native.names[-1] == "tm_decode_attention"
    for tensor in (x, residual, paged["query"], paged["k_cache"]):  # new values at the same addresses
        tensor.copy_(torch.randn(tensor.shape, generator=rng))
    expected = [t.clone() for t in _forward(x, residual, weight, paged)]
    for output in outputs:
        output.fill_(float("nan"))
    nanos = np.zeros(len(native.names), dtype=np.int64)
    native.run(nanos)
    for output, want in zip(outputs, expected, strict=True):
        assert torch.equal(output, want)
    assert (nanos > 0).all()


def test_a_refusing_kernel_stops_the_replay_and_is_named():
    x = torch.randn(2, 64)
    silu = cpu_ops.library().tm_silu_and_mul
    out_a, out_b = torch.zeros(2, 32), torch.zeros(2, 32)

    def converted(dtype: int, out: torch.Tensor) -> tuple:
        values = (dtype, out.data_ptr(), x.data_ptr(), 64, 2, 32)
        return tuple(kind(value) for kind, value in zip(silu.argtypes, values, strict=True))

    native = call_replay.NativeCalls.build([(silu, converted(9, out_a)), (silu, converted(0, out_b))])  # 9: no dtype
    assert native is not None
    with pytest.raises(RuntimeError, match="tm_silu_and_mul refused"):
        native.run()
    assert not out_b.any()  # the call after the refusing one did not run


def test_calls_it_cannot_lay_out_are_left_to_the_python_loop():
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    ldexp = libm.ldexp  # a double argument, a double result
    ldexp.argtypes, ldexp.restype = [ctypes.c_double, ctypes.c_int], ctypes.c_double
    assert call_replay.NativeCalls.build([(ldexp, (ctypes.c_double(1.5), ctypes.c_int(2)))]) is None
    many = cpu_ops.library().tm_omp_max_threads
    assert call_replay.NativeCalls.build([(many, ())]) is not None


def test_recorded_forwards_replay_through_the_native_loop(monkeypatch):
    runs: list[int] = []
    original = call_replay.NativeCalls.run

    def counted(self, *args):
        runs.append(len(self.names))
        return original(self, *args)

    monkeypatch.setattr(call_replay.NativeCalls, "run", counted)
    x = torch.randn(2, 64)
    replay, output = CpuCallCapture()(lambda: cpu_ops.silu_and_mul(x))
    runs.clear()
    x.copy_(torch.randn(2, 64))
    replay()
    assert runs == [1] and torch.equal(output, cpu_ops.silu_and_mul(x))
