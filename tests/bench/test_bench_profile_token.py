"""scripts/profile_token.py's parts that run fast: the message hops between two real processes, the kernel timer
that sees eager and replayed kernel calls alike."""

from __future__ import annotations

import profile_token
import pytest
import torch
from benchlib.message_hops import message_round_trips_ms

from tokenmill.kernels import cpu_ops
from tokenmill.workers.cpu_graphs import CpuCallCapture


def test_message_round_trips_are_timed_between_processes():
    hops = message_round_trips_ms(count=50)
    assert set(hops) == {"plan_result", "outputs"}
    assert all(0 < ms < 1000 for ms in hops.values())


def test_kernel_timer_counts_eager_and_replayed_calls():
    if cpu_ops.library() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    x = torch.randn(2, 64)
    replay, _ = CpuCallCapture()(lambda: cpu_ops.silu_and_mul(x))
    times = profile_token.KernelTimes()
    with profile_token.timed_kernels(times):
        cpu_ops.silu_and_mul(x)
        replay()
    assert set(times.per_name) == {"tm_silu_and_mul"} and times.other > 0 and times.matmul == 0
    before = times.other
    cpu_ops.silu_and_mul(x)  # the timers are gone once the block ends
    replay()
    assert times.other == before
