"""The CPU kernels of `cpu_ops.cpp`: built once per machine, loaded with ctypes, wrapped for torch tensors.

`library()` compiles the source with the system C++ compiler (`$CXX`, default g++; about two seconds) into
`$TOKENMILL_CACHE_DIR` (default `~/.cache/tokenmill`), keyed by the source, the flags and the CPU, and returns None
when it cannot (no compiler, a failed build): the worker then keeps its torch code, so a machine without a compiler
is slower, never broken. `TOKENMILL_CPU_KERNELS=0` makes the worker use the torch code without trying.

Loading a shared object runs its code, so only a file this user built is loaded: the cache directory is created 0700,
and it and the library must belong to this user and be writable by nobody else. A cache that fails that check is
refused with one warning and the kernels are built into a fresh private directory instead.

The wrappers take and return torch tensors. What they replace is the worker's own torch code
(`workers/attention.py`, `workers/models/layers.py`), which the tests compare them with.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenmill.private_cache import UntrustedCache, cache_dir, private_dir, require_private

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP8_CODES = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}  # KV cache dtypes (kernels/kv_quant.py)

_PTR, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tm_omp_max_threads": [],
    "tm_decode_attention": [
        _I32,
        _I32,
        _PTR,
        _PTR,
        _I64,
        _PTR,
        _PTR,
        _I64,
        _I64,
        _I64,
        _I64,
        _PTR,
        _I64,
        _PTR,
        _PTR,
        _I64,
        _I64,
        ctypes.c_float,
        _I64,
        ctypes.c_float,
        ctypes.c_float,
    ],
    "tm_write_kv": [_I32, _I32, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_float],
    "tm_fp8_convert": [_I32, _I32, _PTR, _PTR, _I64],
    "tm_rms_norm": [_I32, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, ctypes.c_float],
    "tm_rotary": [_I32, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64],
    "tm_silu_and_mul": [_I32, _PTR, _PTR, _I64, _I64, _I64],
    "tm_apply_token_bitmask": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64],
}


def native_flags() -> tuple[str, ...]:
    """FLAGS, without AVX-512 code where `TOKENMILL_CPU_ISA` (kernels/gguf_ops.py) forces a lower x86 version: the
    small kernels are then built as on an AVX2 machine, like the GGUF kernels run (a benchmark or a test of the AVX2
    paths on an AVX-512 machine)."""
    forced = os.environ.get("TOKENMILL_CPU_ISA")
    if forced in ("avx2", "scalar") and platform.machine().lower() in ("x86_64", "amd64"):
        return (*FLAGS, "-mno-avx512f")
    return FLAGS


def _cpu_signature() -> str:
    """What -march=native depends on, so a cache shared between machines never serves a foreign build."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def library_name(compiler: str, source: Path | None = None, flags: tuple[str, ...] | None = None) -> str:
    """The cached library's file name: it names the source, the compiler, the flags and the CPU."""
    source, flags = source or SOURCE, flags or native_flags()
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                compiler.encode(),
                " ".join(flags).encode(),
                platform.machine().encode(),
                _cpu_signature().encode(),
            ]
        )
    ).hexdigest()[:16]
    return f"{source.stem}-{key}.so"


def build(compiler: str | None = None, source: Path | None = None, flags: tuple[str, ...] | None = None) -> Path:
    """Compile `source` (default `cpu_ops.cpp`) with `flags` (default `native_flags()`) unless this exact build is
    cached; returns the shared library's path, checked private. Other kernel sources (`gguf_ops.py`) build through
    here too.

    Raises `RuntimeError` with the compiler's message when the build fails.
    """
    compiler = compiler or os.environ.get("CXX", "g++")
    source, flags = source or SOURCE, flags or native_flags()
    name = library_name(compiler, source, flags)
    try:
        return _cached_or_built(cache_dir(), name, compiler, source, flags)
    except UntrustedCache as exc:
        log.warning("refusing the CPU kernel cache (%s); building into a fresh private directory instead", exc)
        return _cached_or_built(Path(tempfile.mkdtemp(prefix="tokenmill-cpu-ops-")), name, compiler, source, flags)


def _cached_or_built(directory: Path, name: str, compiler: str, source: Path, flags: tuple[str, ...]) -> Path:
    target = private_dir(directory) / name
    if target.exists():
        require_private(target)
        return target
    # Build beside the target and rename: concurrent workers each build, and every reader sees a whole file.
    fd, partial = tempfile.mkstemp(dir=directory, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(source), "-o", partial], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} could not build {source.name}: {done.stderr.strip()[-2000:]}")
        os.chmod(partial, 0o755)
        os.replace(partial, target)
    except FileNotFoundError as exc:
        raise RuntimeError(f"no C++ compiler {compiler!r} to build {source.name}") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load(source: Path, signatures: dict[str, list], flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Build `source` (cached), load it and declare its functions (each returning a C int status). Every kernel
    library loads through here. Raises `RuntimeError` or `OSError` where it cannot be built or loaded."""
    path = build(source=source, flags=flags)
    require_private(path)  # again right before loading: this is the file whose code runs
    lib = ctypes.CDLL(str(path))
    declare(lib, signatures, ctypes.c_int)
    return lib


def declare(lib: ctypes.CDLL, signatures: dict[str, list], restype: type) -> None:
    """Set the argument and return types of `lib`'s functions named in `signatures`."""
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (logged once) where they cannot be built."""
    try:
        return load(SOURCE, _SIGNATURES)
    except (RuntimeError, OSError) as exc:
        log.warning("CPU kernels unavailable, using the slower torch code instead: %s", exc)
        return None


def library_built_with(flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernels built with `flags` (`native_flags()` under another `TOKENMILL_CPU_ISA`, say), loaded beside
    `library()`'s: the tests run each ISA's code paths on one machine. Raises as `load` does."""
    return load(SOURCE, _SIGNATURES, flags)


def _call(name: str, dtype: torch.dtype, *args) -> None:
    if getattr(library(), name)(DTYPE_CODES.get(dtype, -1), *args) != 0:
        raise ValueError(f"{name}: unsupported dtype {dtype}")


def _call_kv(name: str, dtype: torch.dtype, cache_dtype: torch.dtype, *args) -> None:
    """A KV kernel: the cache holds `dtype`, a 16-bit float under float32 `dtype`, or fp8 (then `args` end with the k
    and v scales it applies)."""
    codes = (DTYPE_CODES.get(dtype, -1), FP8_CODES.get(cache_dtype, DTYPE_CODES.get(cache_dtype, -1)))
    if getattr(library(), name)(*codes, *args) != 0:
        raise ValueError(f"{name}: unsupported dtypes {dtype} with a {cache_dtype} KV cache")


def _kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a kernel applies: an fp8 cache's, else none (a cache in the model's dtype ignores them)."""
    return (float(k_scale), float(v_scale)) if cache_dtype in FP8_CODES else (1.0, 1.0)


def fp8_convert(x: torch.Tensor, to_fp8: bool, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float32 -> fp8 (to_fp8) or fp8 -> float32 with the kernels' own conversion (tests hold it to torch's)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=fp8_dtype if to_fp8 else torch.float32)
    assert x.dtype == (torch.float32 if to_fp8 else fp8_dtype)
    if library().tm_fp8_convert(FP8_CODES[fp8_dtype], int(to_fp8), x.data_ptr(), out.data_ptr(), x.numel()) != 0:
        raise ValueError(f"fp8_convert: unsupported dtype {fp8_dtype}")
    return out


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`[T, heads, D]` whose heads and dims are packed within a token (a slice of a fused qkv row qualifies)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_query_len: int = 1,
) -> torch.Tensor:
    """Into `out [T, Hq, D]` (contiguous), the causal attention of every sequence with 1 to `max_query_len` query
    tokens over its `seq_lens[b]` cached tokens: its query i of q_len, at position seq_lens[b] - q_len + i, sees the
    keys up to its own (the last `sliding_window` of them; no block before the earliest query's window is read).
    Rows of sequences with more query tokens are left as they are.

    query `[T, Hq, D]`; caches `[num_blocks, block_size, Hkv, D]` already holding this step's K/V; block_tables
    `[B, max_blocks]`, query_start_loc `[B + 1]` and seq_lens `[B]` int32. The caches hold the query's dtype, or
    fp8 holding keys / k_scale and values / v_scale. A few query tokens (a speculative-decoding verification step)
    cost about one token's memory traffic: each K/V block is read once for all of a sequence's queries.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    assert out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == query_start_loc.dtype == seq_lens.dtype == torch.int32
    assert query.dtype == out.dtype and k_cache.dtype == v_cache.dtype and num_heads % num_kv_heads == 0
    query = _heads_contiguous(query)
    block_tables = _rows(block_tables)
    _call_kv(
        "tm_decode_attention",
        query.dtype,
        k_cache.dtype,
        out.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_size,
        num_kv_heads,
        num_heads,
        head_dim,
        block_tables.data_ptr(),
        block_tables.stride(0),
        query_start_loc.contiguous().data_ptr(),
        seq_lens.contiguous().data_ptr(),
        seq_lens.shape[0],
        max_query_len,
        scale,
        sliding_window or 0,
        *_kv_scales(k_cache.dtype, k_scale, v_scale),
    )
    return out


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Copy key/value `[T, Hkv, D]` into the caches at flat slots `slot_mapping [T]` (int64; -1 skips), in place;
    an fp8 cache stores key / k_scale and value / v_scale (rounded as torch's `.to(fp8)`)."""
    assert key.dtype == value.dtype and k_cache.dtype == v_cache.dtype and slot_mapping.dtype == torch.int64
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    key, value = _heads_contiguous(key), _heads_contiguous(value)
    _call_kv(
        "tm_write_kv",
        key.dtype,
        k_cache.dtype,
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.contiguous().data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2],
        *_kv_scales(k_cache.dtype, k_scale, v_scale),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for `x [T, H]`, as `RMSNorm.forward`; with no residual the second is x."""
    x = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    residual_out = x if residual is None else torch.empty(x.shape, dtype=x.dtype)
    residual_in = None if residual is None else _rows(residual)
    _call(
        "tm_rms_norm",
        x.dtype,
        out.data_ptr(),
        out.stride(0),
        residual_out.data_ptr(),
        residual_out.stride(0),
        x.data_ptr(),
        x.stride(0),
        0 if residual_in is None else residual_in.data_ptr(),
        0 if residual_in is None else residual_in.stride(0),
        weight.contiguous().data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
    )
    return out, residual_out


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, Hq, D]` and k `[T, Hkv, D]` in place (NeoX style) by their positions' rows of the float32
    `[max_position, rot_dim]` table (cos half, then sin half); returns them."""
    assert q.dtype == k.dtype and cos_sin_table.dtype == torch.float32 and cos_sin_table.is_contiguous()
    assert q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == q.shape[2], "rotate views in place"
    positions = positions.to(torch.int64).contiguous()
    _call(
        "tm_rotary",
        q.dtype,
        q.data_ptr(),
        q.stride(0),
        q.shape[1],
        k.data_ptr(),
        k.stride(0),
        k.shape[1],
        q.shape[2],
        positions.data_ptr(),
        cos_sin_table.data_ptr(),
        cos_sin_table.shape[1],
        q.shape[0],
    )
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `x [T, 2 * W]` holding gate then up; returns `[T, W]`."""
    x = _rows(x)
    width = x.shape[1] // 2
    out = torch.empty((x.shape[0], width), dtype=x.dtype)
    _call("tm_silu_and_mul", x.dtype, out.data_ptr(), x.data_ptr(), x.stride(0), x.shape[0], width)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask, mask_rows: list[int], logit_rows: list[int]) -> None:
    """In place: `logits[logit_rows[i]]` (float32, [N, V]) gets -inf wherever row `mask_rows[i]` of `bitmask` (a C
    contiguous int32 numpy array, [R, ceil(V / 32)], llguidance's layout) does not allow the token; a row allowing
    nothing is left as it is. The torch code it replaces: `workers/grammar_mask.py`."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("apply_token_bitmask needs float32 logits with contiguous rows")
    mask_index = torch.tensor(mask_rows, dtype=torch.int64)
    logit_index = torch.tensor(logit_rows, dtype=torch.int64)
    library().tm_apply_token_bitmask(
        logits.data_ptr(),
        logits.stride(0),
        logits.shape[1],
        bitmask.ctypes.data,
        bitmask.shape[1],
        mask_index.data_ptr(),
        logit_index.data_ptr(),
        len(mask_rows),
    )
