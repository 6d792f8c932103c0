"""Matmuls straight on GGUF-quantized weights, on the CPU: `y = x @ W^T` with W kept in llama.cpp's blocks.

The kernels are `gguf_cpu.cpp`, built and loaded through `cpu_ops.build` (the same cached, private build as the
other CPU kernels, into a library of its own). They quantize each activation row to int8 once and take integer dot
products with the unpacked weight blocks, as llama.cpp does, so results differ from a float matmul by that int8
rounding (about 0.4% of the activations' block maximum per element; see the tests). `activations="float"` instead
multiplies the float activations with the weights dequantized in registers (the dequantized-weight matmul up to float
summation order; slower at batch 1). The default is `TOKENMILL_GGUF_ACTIVATIONS` (float or int8, int8 unless set).
The library is built for the baseline of the architecture and picks its instruction set when loaded (AVX-512 VNNI,
AVX2, NEON or portable C++); `TOKENMILL_CPU_ISA=scalar|avx2|avx512|neon` or `set_isa` forces a lower one.

Repacking (the 32-wide types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; and Q2_K, Q3_K, Q4_K): `repack_rows` reorders a
weight's blocks so that each group of 8 output rows stores block b of its 8 rows together, scales side by side and
quants interleaved in 4-byte groups (the layout is spelled out in gguf_cpu.cpp at `packed_segments`, `packed_rows`,
`packed_q2_k_rows` and `packed_q4_k_rows`; the last `out_features % 8` rows stay plain), and
`gguf_matmul(..., repacked=True)` runs the kernel for that layout: one vpdpbusd (AVX2: maddubs) yields 8 rows' partial
dot products and the scales are applied once per 8 rows, several times faster than the plain kernel at 2-8 activation
rows and faster at 1 (scripts/bench_gguf_kernels.py; batch-1 GEMV against the read bandwidth:
scripts/bench_gguf_gemv.py). The same integer products, so the same int8 math; only the float summation order differs,
and it does not depend on the batch (a row's result is the same bits alone or among others).
`GGUFWeight.pack_for_matmul` repacks a loaded weight in place when `repack_wanted` says so: these types, the int8
activation mode, and an x86 version in use (AVX-512 VNNI or AVX2; the portable and NEON versions run the layout,
correctly but without the gain, so they keep the plain one). `TOKENMILL_GGUF_REPACK=0` turns repacking off (the plain
kernels run: the comparison baseline).

Where the kernels cannot be built (no compiler) or `TOKENMILL_CPU_KERNELS=0`, `gguf_matmul` dequantizes the blocks
with the `gguf` package and multiplies with torch: correct, much slower, and logged once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from tokenmill.kernels import cpu_ops, row_ops

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_cpu.cpp")

SUPPORTED_TYPES: frozenset[int] = frozenset(
    int(t)
    for t in (
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.IQ4_NL,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    )
)

ISA_CODES = {"scalar": 0, "neon": 1, "avx2": 2, "avx512": 3}
_ISA_NAMES = {code: name for name, code in ISA_CODES.items()}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_PTR, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tm_gguf_isa_supported": [_I32],
    "tm_gguf_isa": [],
    "tm_gguf_set_isa": [_I32],
    "tm_gguf_block_bytes": [_I32],
    "tm_gguf_matmul": [_I32, _I32, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64],
    "tm_gguf_matmul_repacked": [_I32, _I32, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64],
    "tm_gguf_matmul_float": [_I32, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64],
    "tm_gguf_matmul_float_repacked": [_I32, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64],
    "tm_gguf_repack": [_I32, _PTR, _I64, _I64, _PTR],
    "tm_gguf_unpack_rows": [_I32, _PTR, _I64, _I64, _PTR, _I64, _PTR],
    "tm_gguf_matmul_cycle": [_I32, _I32, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR],
}
# scripts/bench_gguf_gemv.py's read-bandwidth loops (return their 64-bit sums)
_U64_SIGNATURES = {"tm_gguf_stream_sum": [_PTR, _I64], "tm_gguf_read_sum": [_I32, _PTR, _I64, _I32, _I64]}

# Each repacked type's block as byte ranges of the plain block, (offset, length, unit), in their repacked order: each
# range holds the 8 rows' bytes interleaved in pieces of `unit` bytes (gguf_cpu.cpp's packed_segments). The 32-wide
# types and Q4_K: the fp16 scale (and min; Q4_K: d, dmin and 12 bytes of packed scales and mins) in 2-byte pieces,
# then the quants in 4-byte groups (Q5_0 / Q5_1: their 4-byte qh first). Some bytes are stored with their bits
# reordered first (_stored_bit_order).
_PACKED_SEGMENTS: dict[int, tuple[tuple[int, int, int], ...]] = {
    int(GGMLQuantizationType.Q4_0): ((0, 2, 2), (2, 16, 4)),
    int(GGMLQuantizationType.Q4_1): ((0, 4, 2), (4, 16, 4)),
    int(GGMLQuantizationType.Q5_0): ((0, 2, 2), (2, 20, 4)),
    int(GGMLQuantizationType.Q5_1): ((0, 4, 2), (4, 20, 4)),
    int(GGMLQuantizationType.Q8_0): ((0, 2, 2), (2, 32, 4)),
    int(GGMLQuantizationType.IQ4_NL): ((0, 2, 2), (2, 16, 4)),
    # d and dmin, the 16 bytes of 4-bit scales and mins one by one (a sub-block's 8 rows side by side), the quants
    int(GGMLQuantizationType.Q2_K): ((80, 4, 2), (0, 16, 1), (16, 64, 4)),
    # d, the 12 bytes of 6-bit scales, hmask and the quants recoded as 3-bit values (_stored_bit_order)
    int(GGMLQuantizationType.Q3_K): ((108, 2, 2), (96, 12, 1), (0, 96, 4)),
    int(GGMLQuantizationType.Q4_K): ((0, 16, 2), (16, 128, 4)),
}
# The types with a repacked layout.
REPACK_TYPES: frozenset[int] = frozenset(_PACKED_SEGMENTS)
REPACK_ROWS = 8  # output rows per repacked group

ACTIVATION_MODES = ("float", "int8")


def _default_activations() -> str:
    mode = os.environ.get("TOKENMILL_GGUF_ACTIVATIONS", "int8")
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"TOKENMILL_GGUF_ACTIVATIONS must be one of {ACTIVATION_MODES}, got {mode!r}")
    return mode


# How gguf_matmul takes the activations unless told: "float" (weights dequantized in registers, float32 FMA: the
# dequantized-weight matmul up to summation order) or "int8" (llama.cpp's int8 activation quantization).
DEFAULT_ACTIVATIONS: str = _default_activations()


def repack_enabled() -> bool:
    """`TOKENMILL_GGUF_REPACK` (1 unless set; 0 keeps every weight in the plain layout)."""
    value = os.environ.get("TOKENMILL_GGUF_REPACK", "1")
    if value not in ("0", "1"):
        raise ValueError(f"TOKENMILL_GGUF_REPACK must be 0 or 1, got {value!r}")
    return value == "1"


def build_flags() -> tuple[str, ...]:
    """No -march=native on x86: the library carries AVX2 and AVX-512 versions and picks one at run time, so the
    scalar and AVX2 versions stay runnable (and tested) on a machine that has more. The compiler fuses multiply-adds
    where the target has FMA (the SIMD versions): the activations then round to int8 from the exact x * (127 / max),
    not from its float32 rounding (tests/kernels/test_gguf_cpu_kernels.quantized_activations models both; turning
    the fusion off moved the shipped model's greedy int8 output off its tested near-tie budget)."""
    base = ("-O3", "-fno-trapping-math", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return base
    if machine in ("aarch64", "arm64"):
        return (*base, "-mcpu=native")  # dotprod where the CPU has it
    return (*base, "-march=native")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded GGUF kernels, or None (logged once) where they cannot be built or are turned off."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        log.warning("GGUF CPU kernels turned off (TOKENMILL_CPU_KERNELS=0): dequantizing to float for every matmul")
        return None
    try:
        lib = cpu_ops.load(SOURCE, _SIGNATURES, flags=build_flags())
    except (RuntimeError, OSError) as exc:
        log.warning("GGUF CPU kernels unavailable, dequantizing to float for every matmul (slow): %s", exc)
        return None
    cpu_ops.declare(lib, _U64_SIGNATURES, ctypes.c_uint64)
    forced = os.environ.get("TOKENMILL_CPU_ISA")
    if forced:
        if forced not in ISA_CODES or lib.tm_gguf_set_isa(ISA_CODES[forced]) != 0:
            log.warning(
                "TOKENMILL_CPU_ISA=%s is not available here (available: %s); using %s",
                forced,
                ", ".join(_available(lib)),
                _ISA_NAMES[lib.tm_gguf_isa()],
            )
    return lib


def _available(lib: ctypes.CDLL) -> list[str]:
    return [name for name, code in ISA_CODES.items() if lib.tm_gguf_isa_supported(code)]


def available_isas() -> list[str]:
    """The instruction-set versions this machine can run ([] without the kernels)."""
    lib = library()
    return [] if lib is None else _available(lib)


def isa() -> str:
    """The version in use: "avx512", "avx2", "neon", "scalar", or "torch" (dequantize + torch matmul)."""
    lib = library()
    return "torch" if lib is None else _ISA_NAMES[lib.tm_gguf_isa()]


def set_isa(name: str | None) -> None:
    """Use the `name` version from now on (None: the best one); ValueError if this machine cannot run it."""
    lib = library()
    if lib is None:
        raise ValueError("the GGUF CPU kernels are not available")
    if name is None:
        lib.tm_gguf_set_isa(-1)
    elif name not in ISA_CODES or lib.tm_gguf_set_isa(ISA_CODES[name]) != 0:
        raise ValueError(f"instruction set {name!r} not available here; available: {_available(lib)}")


@functools.cache
def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes per weight row of `in_features` values; ValueError unless it is a whole number of blocks."""
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"qtype {qtype} is not one of the supported GGML types {sorted(SUPPORTED_TYPES)}")
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if in_features <= 0 or in_features % block_elems:
        raise ValueError(
            f"in_features {in_features} is not a multiple of {GGMLQuantizationType(qtype).name}'s "
            f"block of {block_elems}"
        )
    return in_features // block_elems * block_bytes


def _check_blocks(blocks: torch.Tensor, qtype: int, out_features: int, in_features: int) -> None:
    expected = (out_features, row_bytes(qtype, in_features))
    if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" or blocks.shape != expected:
        raise ValueError(
            f"blocks must be a uint8 CPU tensor of shape {expected}, got {blocks.dtype} "
            f"{tuple(blocks.shape)} on {blocks.device}"
        )
    if not blocks.is_contiguous():
        raise ValueError("blocks must be contiguous")


def dequantize_rows(
    blocks: torch.Tensor, qtype: int, out_features: int, in_features: int, repacked: bool = False
) -> torch.Tensor:
    """The float32 `[out_features, in_features]` weights the blocks (plain, or `repacked`) encode (the `gguf`
    package's dequantizer; its bits from `row_ops`' kernel for the types that has, as an embedding lookup's row)."""
    _check_blocks(blocks, qtype, out_features, in_features)
    if repacked:
        blocks = unpack_rows(blocks, qtype, out_features, in_features)
    native = row_ops.dequantize_rows(blocks, qtype, in_features)
    if native is not None:
        return native
    values = gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(out_features, in_features)


@functools.cache
def _group_permutation(qtype: int) -> np.ndarray:
    """Byte j of a repacked block group is byte `perm[j]` of the group's 8 blocks laid end to end, each as stored
    (`_recode_blocks`)."""
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]
    perm = [
        r * block_bytes + offset + p + i
        for offset, length, unit in _PACKED_SEGMENTS[qtype]
        for p in range(0, length, unit)
        for r in range(REPACK_ROWS)
        for i in range(unit)
    ]
    return np.array(perm, dtype=np.int64)


@functools.cache
def _group_inverse(qtype: int) -> np.ndarray:
    """`[8, block_bytes]`: byte i of row r's stored block is byte `inverse[r, i]` of its group's repacked block."""
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]
    return np.argsort(_group_permutation(qtype)).reshape(REPACK_ROWS, block_bytes)


def _fifth_bits_order() -> np.ndarray:
    """Q5_0 / Q5_1's word of fifth bits, transposed (gguf_cpu.cpp's `transposed_fifth_bits`): bit j of byte i holds
    element 4j + i's fifth bit, bit 4 + j element 16 + 4j + i's."""
    order = np.empty(32, dtype=np.int64)
    for i in range(4):
        for j in range(4):
            order[8 * i + j] = 4 * j + i
            order[8 * i + 4 + j] = 16 + 4 * j + i
    return order


def _q3_k_values_order() -> np.ndarray:
    """Q3_K's 32 bytes of hmask and 64 of quants as 3-bit values (gguf_cpu.cpp's `q3_k_values_stored`): element
    128 n + 32 f + l's value (v = 4 n + f; bits 0, 1 from quant byte 32 n + l, bit 2 from hmask byte l's bit v), for
    l = 4 i + k, in bytes 12 i + k (A: u_0, u_1, two bits of u_2), 12 i + 4 + k (B: u_3, u_4, two bits of u_5) and
    12 i + 8 + k (C: u_6, u_7, then the third bits of u_2 and u_5)."""

    def source(v: int, bit: int, pos: int) -> int:  # the plain bit holding bit `bit` of value v at l = pos
        return 8 * pos + v if bit == 2 else 8 * (32 + 32 * (v // 4) + pos) + 2 * (v % 4) + bit

    fields = [  # per stored byte A, B, C: the (value, bit) of its bits 0..7
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)],
        [(3, 0), (3, 1), (3, 2), (4, 0), (4, 1), (4, 2), (5, 0), (5, 1)],
        [(6, 0), (6, 1), (6, 2), (7, 0), (7, 1), (7, 2), (2, 2), (5, 2)],
    ]
    order = np.empty(96 * 8, dtype=np.int64)
    for pos in range(32):
        for c, field in enumerate(fields):
            byte = 12 * (pos // 4) + 4 * c + pos % 4
            for bit, (v, value_bit) in enumerate(field):
                order[8 * byte + bit] = source(v, value_bit, pos)
    return order


@functools.cache
def _stored_bit_order(qtype: int) -> tuple[int, np.ndarray] | None:
    """Where a type's repacked layout keeps bytes of a block with their bits reordered: (offset, order), bit k of
    the stored bytes from offset on being bit `order[k]` of the plain ones (the kernels take these with fewer ops);
    None where a block is stored as it is."""
    if qtype in (int(GGMLQuantizationType.Q5_0), int(GGMLQuantizationType.Q5_1)):
        return (2 if qtype == int(GGMLQuantizationType.Q5_0) else 4), _fifth_bits_order()
    if qtype == int(GGMLQuantizationType.Q3_K):
        return 0, _q3_k_values_order()
    return None


def _recode_blocks(blocks: np.ndarray, qtype: int, to_stored: bool) -> np.ndarray:
    """`blocks` (`[..., block_bytes]`, uint8) as the repacked layout stores them (`to_stored`) or back (a copy)."""
    recode = _stored_bit_order(qtype)
    if recode is None:
        return blocks
    offset, order = recode
    if not to_stored:
        order = np.argsort(order)
    out = blocks.copy()
    span = slice(offset, offset + order.size // 8)
    bits = np.unpackbits(out[..., span], axis=-1, bitorder="little")[..., order]
    out[..., span] = np.packbits(bits, axis=-1, bitorder="little")
    return out


def _check_repack_type(qtype: int) -> None:
    if qtype not in REPACK_TYPES:
        raise ValueError(f"qtype {qtype} has no repacked layout (only {sorted(REPACK_TYPES)})")


def repack_wanted(qtype: int, out_features: int) -> bool:
    """Whether a weight of this type and height should be repacked here: TOKENMILL_GGUF_REPACK allows it, the type
    has the layout, the activations are int8 (the float mode gains nothing from it), at least one whole group
    of 8 rows, and the kernels in use are an x86 version (where the repacked kernel is the fast one)."""
    return (
        repack_enabled()
        and qtype in REPACK_TYPES
        and DEFAULT_ACTIVATIONS == "int8"
        and out_features >= REPACK_ROWS
        and isa() in ("avx512", "avx2")
    )


def repack_rows(
    blocks: torch.Tensor, qtype: int, out_features: int, in_features: int, numpy: bool = False
) -> torch.Tensor:
    """The plain blocks `[out_features, row_bytes]` in the repacked layout (same shape and bytes, reordered within
    each group of 8 rows; the last `out_features % 8` rows unchanged): `gguf_matmul(..., repacked=True)`'s input.
    By the compiled kernels' byte moves where they are loaded, else (or with `numpy`) by numpy indexing."""
    _check_repack_type(qtype)
    _check_blocks(blocks, qtype, out_features, in_features)
    lib = library()
    if lib is not None and not numpy:  # the same bytes moved, 20-50x faster than numpy's fancy indexing
        out = torch.empty_like(blocks)
        if lib.tm_gguf_repack(qtype, blocks.data_ptr(), out_features, in_features, out.data_ptr()) != 0:
            raise ValueError(f"tm_gguf_repack refused qtype {qtype}, in_features {in_features}")
        return out
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]
    nb, whole = row_bytes(qtype, in_features) // block_bytes, out_features // REPACK_ROWS * REPACK_ROWS
    plain = blocks.numpy()
    stored = _recode_blocks(plain[:whole].reshape(-1, REPACK_ROWS, nb, block_bytes), qtype, to_stored=True)
    groups = stored.transpose(0, 2, 1, 3).reshape(-1, nb, REPACK_ROWS * block_bytes)[..., _group_permutation(qtype)]
    out = np.concatenate([groups.reshape(whole, -1), plain[whole:]])
    return torch.from_numpy(out)


def gather_rows(
    blocks: torch.Tensor, qtype: int, in_features: int, ids: torch.Tensor, repacked: bool = False, numpy: bool = False
) -> torch.Tensor:
    """Rows `ids` (any shape, flattened) of the weight as plain blocks `[ids.numel(), row_bytes]`, from plain or
    repacked blocks (by the compiled kernels where they are loaded, else or with `numpy` by numpy indexing)."""
    ids = ids.reshape(-1).long()
    if not repacked:
        return blocks.index_select(0, ids)
    _check_repack_type(qtype)
    out_features = blocks.shape[0]
    _check_blocks(blocks, qtype, out_features, in_features)
    lib = library()
    if lib is not None and not numpy:
        ids = ids.contiguous()
        out = torch.empty((ids.numel(), blocks.shape[1]), dtype=torch.uint8)
        status = lib.tm_gguf_unpack_rows(
            qtype, blocks.data_ptr(), out_features, in_features, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        if status == -3:
            raise IndexError(f"row ids out of range for {out_features} rows")
        if status != 0:
            raise ValueError(f"tm_gguf_unpack_rows refused qtype {qtype}, in_features {in_features}")
        return out
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]
    nb, whole = row_bytes(qtype, in_features) // block_bytes, out_features // REPACK_ROWS * REPACK_ROWS
    index = ids.numpy()
    if index.size and (index.min() < 0 or index.max() >= out_features):
        raise IndexError(f"row ids out of range for {out_features} rows")
    out = np.empty((index.size, nb, block_bytes), dtype=np.uint8)
    in_groups = index < whole
    if in_groups.any():
        groups = blocks.numpy()[:whole].reshape(-1, nb, REPACK_ROWS * block_bytes)
        # byte i of row r's stored block sits at inverse[r, i] in its group's repacked block
        inverse = _group_inverse(qtype)
        picked = index[in_groups]
        stored = groups[
            (picked // REPACK_ROWS)[:, None, None],
            np.arange(nb)[None, :, None],
            inverse[picked % REPACK_ROWS][:, None, :],
        ]
        out[in_groups] = _recode_blocks(stored, qtype, to_stored=False)
    if (~in_groups).any():
        out[~in_groups] = blocks.numpy()[index[~in_groups]].reshape(-1, nb, block_bytes)
    return torch.from_numpy(out.reshape(index.size, -1))


def unpack_rows(blocks: torch.Tensor, qtype: int, out_features: int, in_features: int) -> torch.Tensor:
    """The plain blocks of repacked ones (repack_rows' inverse)."""
    _check_blocks(blocks, qtype, out_features, in_features)
    return gather_rows(blocks, qtype, in_features, torch.arange(out_features), repacked=True)


@functools.cache
def _log_fallback_once() -> None:
    log.warning("gguf_matmul: no compiled kernels, dequantizing the weights to float on every call (slow)")


class Int8Matmul(Protocol):
    """`int8_matmul_on`'s function: x `[T, in_features]` -> `[T, out_features]`, into `out` where given (x's dtype,
    unit column stride; its rows may be strided, as a column slice of a wider output)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...


def int8_matmul_on(
    blocks: torch.Tensor, qtype: int, out_features: int, in_features: int, repacked: bool = False
) -> Int8Matmul | None:
    """`gguf_matmul(x, blocks, ..., activations="int8", repacked=repacked)` as a function of x alone, the blocks
    checked once (a weight's per-call Python cost was as much as a small layer's kernel time); None without the
    kernels. Keeps `blocks` alive; x of any other kind than float32 / bfloat16 [T, in_features] with unit column
    stride goes through gguf_matmul (and its errors), as does an `out` the kernel cannot write (then copied in)."""
    _check_blocks(blocks, qtype, out_features, in_features)
    if repacked:
        _check_repack_type(qtype)
    lib = library()
    if lib is None:
        return None
    # looked up on the library at each call, so a recording of the calls (workers/cpu_graphs.py) sees this one too
    kernel_name = "tm_gguf_matmul_repacked" if repacked else "tm_gguf_matmul"
    pointer = blocks.data_ptr()

    def matmul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        dtype_code = _DTYPE_CODES.get(x.dtype)
        if dtype_code is None or x.ndim != 2 or x.shape[1] != in_features or x.stride(1) != 1 or not x.is_cpu:
            result = gguf_matmul(x, blocks, qtype, out_features, in_features, activations="int8", repacked=repacked)
            return result if out is None else out.copy_(result)
        if out is None:
            out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
        elif not _writable_output(out, x, out_features):
            return out.copy_(matmul(x))
        row_stride = out.stride(0) if out.shape[0] > 1 else out_features
        if (
            getattr(lib, kernel_name)(
                qtype,
                dtype_code,
                x.data_ptr(),
                x.stride(0),
                pointer,
                x.shape[0],
                out_features,
                in_features,
                out.data_ptr(),
                row_stride,
            )
            != 0
        ):
            raise ValueError(f"tm_gguf_matmul refused qtype {qtype}, dtype {x.dtype}, in_features {in_features}")
        return out

    return matmul


def _writable_output(out: torch.Tensor, x: torch.Tensor, out_features: int) -> bool:
    """Whether the kernel can write x's product into `out` directly: `[T, out_features]` of x's dtype on the CPU, unit
    column stride, rows at least a row apart."""
    if out.dtype != x.dtype or not out.is_cpu or tuple(out.shape) != (x.shape[0], out_features):
        return False
    return out.stride(1) == 1 and (out.shape[0] <= 1 or out.stride(0) >= out_features)


def gguf_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    out_features: int,
    in_features: int,
    activations: str | None = None,
    repacked: bool = False,
) -> torch.Tensor:
    """`x [T, in_features] @ W^T` -> `[T, out_features]` in x's dtype (float32 or bfloat16), W being the GGUF
    blocks `[out_features, row_bytes]` (uint8, contiguous). x's rows may be strided; the sum is taken in float32.
    `activations`: "float" multiplies the float activations with the weights dequantized in registers, "int8"
    quantizes the activations to int8 per block as llama.cpp does; None: DEFAULT_ACTIVATIONS. `repacked`: the blocks
    are in `repack_rows`' layout (the float mode then puts each group of 8 rows back in the plain layout on the fly:
    exact, a little slower than on plain blocks)."""
    mode = DEFAULT_ACTIVATIONS if activations is None else activations
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {ACTIVATION_MODES}, got {activations!r}")
    _check_blocks(blocks, qtype, out_features, in_features)
    if repacked:
        _check_repack_type(qtype)
    dtype_code = _DTYPE_CODES.get(x.dtype)
    if x.dim() != 2 or x.shape[1] != in_features or dtype_code is None or x.device.type != "cpu":
        raise ValueError(
            f"x must be a float32 or bfloat16 CPU tensor [T, {in_features}], got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    lib = library()
    if lib is None:
        _log_fallback_once()
        weights = dequantize_rows(blocks, qtype, out_features, in_features, repacked=repacked)
        return (x.float() @ weights.T).to(x.dtype)
    if mode == "float":
        xf = x if x.dtype == torch.float32 and x.stride(1) == 1 else x.float().contiguous()
        out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        matmul = lib.tm_gguf_matmul_float_repacked if repacked else lib.tm_gguf_matmul_float
        status = matmul(
            qtype,
            xf.data_ptr(),
            xf.stride(0),
            blocks.data_ptr(),
            xf.shape[0],
            out_features,
            in_features,
            out.data_ptr(),
            out_features,
        )
        if status != 0:
            raise ValueError(f"tm_gguf_matmul_float refused qtype {qtype}, in_features {in_features}")
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    matmul = lib.tm_gguf_matmul_repacked if repacked else lib.tm_gguf_matmul
    status = matmul(
        qtype,
        dtype_code,
        x.data_ptr(),
        x.stride(0),
        blocks.data_ptr(),
        x.shape[0],
        out_features,
        in_features,
        out.data_ptr(),
        out_features,
    )
    if status != 0:
        raise ValueError(f"tm_gguf_matmul refused qtype {qtype}, dtype {x.dtype}, in_features {in_features}")
    return out
