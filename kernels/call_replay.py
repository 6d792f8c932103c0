"""A recorded list of kernel calls replayed in one native loop (`call_replay.cpp`), for `workers/cpu_graphs.py`.

`NativeCalls.build(calls)` lays the calls out as a C array once (function pointer, integer-class arguments, float
ones); `run()` is then one ctypes call per decode step instead of one per kernel (about a microsecond each, a few
hundred per batch-1 step). It returns None where the trick it relies on is not known to hold (a platform other than
Linux on x86-64 or AArch64, an argument type other than an integer, a pointer or a float32, more arguments than the
layout holds), and the caller keeps its Python loop.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.kernels import cpu_ops

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("call_replay.cpp")
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")
# Platforms whose calling convention assigns integer and float arguments independently (see call_replay.cpp).
SUPPORTED_PLATFORMS = frozenset({("Linux", "x86_64"), ("Linux", "aarch64")})
_INTEGER_TYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint32)


class _Layout(ctypes.Structure):
    _fields_ = [("max_ints", ctypes.c_int64), ("max_floats", ctypes.c_int64), ("call_bytes", ctypes.c_int64)]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded replay loop, or None where this platform is not supported or it cannot be built (logged once)."""
    if (platform.system(), platform.machine()) not in SUPPORTED_PLATFORMS:
        return None
    try:
        lib = cpu_ops.load(SOURCE, {"tm_replay_layout": [ctypes.POINTER(ctypes.c_int64)] * 3}, flags=FLAGS)
    except (RuntimeError, OSError) as exc:
        log.warning("native kernel-call replay unavailable, replaying from Python: %s", exc)
        return None
    replay_calls = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    cpu_ops.declare(lib, {"tm_replay_calls": replay_calls}, ctypes.c_int64)
    return lib


@functools.cache
def _call_struct() -> type[ctypes.Structure] | None:
    """The C `ReplayCall` as a ctypes Structure, its size checked against the library's."""
    lib = library()
    if lib is None:
        return None
    max_ints, max_floats, call_bytes = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    lib.tm_replay_layout(ctypes.byref(max_ints), ctypes.byref(max_floats), ctypes.byref(call_bytes))

    class ReplayCall(ctypes.Structure):
        _fields_ = [
            ("function", ctypes.c_void_p),
            ("ints", ctypes.c_int64 * max_ints.value),
            ("floats", ctypes.c_float * max_floats.value),
        ]

    if ctypes.sizeof(ReplayCall) != call_bytes.value:
        log.warning("native kernel-call replay disagrees on its call layout; replaying from Python")
        return None
    return ReplayCall


def _split_arguments(function: Any, args: tuple[Any, ...]) -> tuple[list[int], list[float]] | None:
    """A call's arguments as (integer-class values, float32 values) in order, or None if a type is not supported."""
    if function.restype is not ctypes.c_int:
        return None
    ints: list[int] = []
    floats: list[float] = []
    for kind, arg in zip(function.argtypes, args, strict=True):
        if kind is ctypes.c_float:
            floats.append(float(arg.value))
        elif kind in _INTEGER_TYPES:
            ints.append(int(arg.value or 0))  # a null c_void_p's value is None
        else:
            return None
    return ints, floats


class NativeCalls:
    """Recorded calls laid out for `tm_replay_calls`; `names[k]` is call k's function name."""

    def __init__(self, table: ctypes.Array[Any], names: list[str]) -> None:
        self.table = table
        self.names = names
        self._run = library().tm_replay_calls  # type: ignore[union-attr]  # built only where the library loaded

    @classmethod
    def build(cls, calls: Sequence[tuple[Any, tuple[Any, ...]]]) -> NativeCalls | None:
        """The calls (ctypes function, arguments already converted to its argtypes) laid out, or None if unsupported."""
        struct = _call_struct()
        if struct is None:
            return None
        table = (struct * len(calls))()
        for entry, (function, args) in zip(table, calls, strict=True):
            split = _split_arguments(function, args)
            if split is None or len(split[0]) > len(entry.ints) or len(split[1]) > len(entry.floats):
                return None
            entry.function = ctypes.cast(function, ctypes.c_void_p).value
            entry.ints[: len(split[0])] = split[0]
            entry.floats[: len(split[1])] = split[1]
        return cls(table, [function.__name__ for function, _ in calls])

    def run(self, nanos: np.ndarray | None = None, clock: int = time.CLOCK_MONOTONIC) -> None:
        """Run every call in order (with `nanos`, an int64 array of len(names), each call's time in ns on `clock`, a
        `time.CLOCK_*` id); raises RuntimeError naming the first kernel that refused its arguments."""
        pointer = None if nanos is None else nanos.ctypes.data
        done = self._run(self.table, len(self.names), pointer, clock)
        if done != len(self.names):
            raise RuntimeError(f"{self.names[done]} refused its recorded arguments on replay")
