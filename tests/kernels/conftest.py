"""Run the Triton kernels in this folder on CUDA when there is a GPU, else through the interpreter.

Without a GPU, TRITON_INTERPRET must be set before Triton is first imported (Triton decorates its
own library functions at import), so it is set here, at the top. That holds when this folder runs
on its own; in a whole-suite run, a test module collected earlier that imports Triton (importing an
HF modeling module does) would come first, which `_require_interpreter` reports instead of letting
every kernel test fail obscurely. With a GPU, tests build their tensors on CUDA (default device).

Triton 3.9's interpreter gets bf16 wrong in two ways the GPU backend does not, so both are fixed
here, for the interpreter only:
- `tl.dot` multiplies bf16 operands as their raw uint16 bit patterns (`create_dot` only converts
  fp8): bf16 operands are widened to fp32 before the matmul;
- fp32 -> bf16 casts truncate the mantissa where the GPU rounds to nearest even: they go through
  torch's (round-to-nearest-even) conversion instead;
and its fp8 casts get fp8 wrong (below, `_fp8_cast_through_torch`).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

TRITON_IMPORTED_INTERPRETED = isinstance(tl.standard.sum, interpreter.InterpretedFunction)


def _widen_bf16(handle: "interpreter.TensorHandle") -> "interpreter.TensorHandle":
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    as_fp32 = (handle.data.astype(np.uint32) << 16).view(np.float32)
    return interpreter.TensorHandle(as_fp32, tl.float32)


_interpreter_create_dot = interpreter.InterpreterBuilder.create_dot


def _create_dot_with_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _interpreter_create_dot(self, _widen_bf16(a), _widen_bf16(b), d, input_precision, max_num_imprecise_acc)


_interpreter_cast_impl = interpreter.InterpreterBuilder.cast_impl


def _cast_rounding_to_bf16(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        rounded = torch.from_numpy(np.asarray(src.data).copy()).to(torch.bfloat16).view(torch.int16)
        return interpreter.TensorHandle(rounded.numpy().view(np.uint16), tl.bfloat16)
    return _interpreter_cast_impl(self, src, dst_type)


interpreter.InterpreterBuilder.create_dot = _create_dot_with_bf16
interpreter.InterpreterBuilder.cast_impl = _cast_rounding_to_bf16

# The interpreter's fp8 conversions neither saturate nor round to nearest even (fp32 1000 becomes e4m3 256), where
# the GPU's (cvt.rn.satfinite) do: casts to or from fp8e4nv / fp8e5 go through torch's conversion instead.
_FP8_TORCH_DTYPES = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
_TORCH_DTYPES = {**_FP8_TORCH_DTYPES, tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}
_interpreter_create_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp


def _fp8_cast_through_torch(self, src, dst_type, rounding_mode):
    src_type, dst_scalar = src.dtype.scalar, dst_type.scalar
    if src_type not in _FP8_TORCH_DTYPES and dst_scalar not in _FP8_TORCH_DTYPES:
        return _interpreter_create_fp_to_fp(self, src, dst_type, rounding_mode)
    data = np.asarray(src.data)
    as_torch = torch.from_numpy(data.reshape(-1).copy()).view(_TORCH_DTYPES[src_type])
    converted = as_torch.to(_TORCH_DTYPES[dst_scalar])
    if dst_scalar in _FP8_TORCH_DTYPES:
        converted = converted.view(torch.uint8)
    elif dst_scalar == tl.bfloat16:
        converted = converted.view(torch.int16).view(torch.uint16)
    return interpreter.TensorHandle(converted.numpy().reshape(data.shape), dst_scalar)


interpreter.InterpreterBuilder.create_fp_to_fp = _fp8_cast_through_torch


@pytest.fixture(autouse=True)
def _require_interpreter() -> None:
    if INTERPRETING and not TRITON_IMPORTED_INTERPRETED:
        pytest.fail(
            "Triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on CPU: "
            "run tests/kernels on its own, or export TRITON_INTERPRET=1 (tests/conftest.py can set it)."
        )


def runs_triton_kernels(test_file: str, marked_cpu_kernel: bool) -> bool:
    """Whether a test of this folder tests the Triton kernels (in a test_kernel_* module, not marked cpu_kernel),
    whose tensors go to the GPU by default, rather than the C++ CPU kernels, whose tensors must stay on the CPU: a
    CUDA pointer handed to a CPU kernel crashes it (the first device run, 2026-11-27: test_call_replay failed, then
    pytest died of SIGSEGV)."""
    return os.path.basename(test_file).startswith("test_kernel_") and not marked_cpu_kernel


@pytest.fixture(autouse=True)
def _device_and_seed(request):
    torch.manual_seed(0)
    marked = request.node.get_closest_marker("cpu_kernel") is not None
    if INTERPRETING or not runs_triton_kernels(str(request.path), marked):
        yield
        return
    torch.set_default_device("cuda")
    yield
    torch.set_default_device(None)
