"""A GGUF file's metadata and tensors, read without turning its arrays into Python objects.

gguf's `GGUFReader` builds a numpy view for every element of every metadata array: a tokenizer's 49,152 vocabulary
strings and merges took 4.6 s of SmolLM2's start-up on a 2-vCPU host, once in the frontend (the model's shape) and
once in the worker (its weights), both on the way to the first request. Here the arrays are stepped over (their
element type and count are kept), scalars and strings are read, and each tensor is a read-only view of the memory-
mapped file shaped as GGUFReader shapes it (a quantized tensor as rows of bytes). Little-endian GGUF v2 and v3.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

STRING, ARRAY = 8, 9
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# tensor types stored as plain numbers (GGUFReader's dtypes); every other type is blocks of bytes
PLAIN_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array, not read: its element type (GGUF's value type code) and length."""

    element_type: int
    count: int


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the innermost (row) dimension first
    data: np.ndarray  # read-only, memory-mapped


@dataclass(frozen=True)
class GGUFIndex:
    fields: dict[str, Any]  # int, float, bool, str, or GGUFArray
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer: mmap.mmap, path: str) -> None:
        self.buffer, self.path, self.offset = buffer, path, 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error:
            raise ValueError(f"{self.path} is not a whole GGUF file: it ends inside its header") from None
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.offset + length > len(self.buffer):
            raise ValueError(f"{self.path} is not a whole GGUF file: a string runs past its end")
        self.offset += length
        return bytes(self.buffer[self.offset - length : self.offset]).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            element_type, count = self.unpack("<I"), self.unpack("<Q")
            self.skip_array(element_type, count)
            return GGUFArray(element_type, count)
        if value_type not in SCALAR_FORMATS:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        return self.unpack(SCALAR_FORMATS[value_type])

    def skip_array(self, element_type: int, count: int) -> None:
        if element_type in SCALAR_FORMATS:
            self.offset += count * struct.calcsize(SCALAR_FORMATS[element_type])
        elif element_type == STRING:
            for _ in range(count):  # each string's length says where the next one starts
                self.offset += 8 + self.unpack("<Q")
        else:
            for _ in range(count):
                self.value(element_type)


def read_gguf(path: str, with_tensors: bool = True) -> GGUFIndex:
    """The file's metadata, and its tensors unless `with_tensors` is False. Raises ValueError for a file that is not
    little-endian GGUF v2 or v3, or ends early."""
    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer, path)
    if buffer[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    cursor.offset = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 little-endian are)")
    tensor_count, field_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(field_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.unpack("<I"))
    if not with_tensors:
        return GGUFIndex(fields, [])
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
        infos.append((name, dims, GGMLQuantizationType(cursor.unpack("<I")), cursor.unpack("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    data_start = -(-cursor.offset // alignment) * alignment
    return GGUFIndex(fields, [_tensor(buffer, data_start, *info, path=path) for info in infos])


def _tensor(
    buffer: mmap.mmap,
    data_start: int,
    name: str,
    dims: tuple[int, ...],
    kind: GGMLQuantizationType,
    offset: int,
    path: str,
) -> GGUFTensor:
    elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    block_size, type_size = GGML_QUANT_SIZES[kind]
    shape = tuple(reversed(dims))
    if kind in PLAIN_DTYPES:
        dtype, count = np.dtype(PLAIN_DTYPES[kind]), elements
    else:
        dtype, count, shape = (
            np.dtype(np.uint8),
            elements * type_size // block_size,
            quant_shape_to_byte_shape(shape, kind),
        )
    start = data_start + offset
    if start + count * dtype.itemsize > len(buffer):
        raise ValueError(f"{path} is not a whole GGUF file: tensor {name} runs past its end")
    data = np.frombuffer(buffer, dtype=dtype, count=count, offset=start).reshape(shape)
    return GGUFTensor(name, kind, dims, data)
