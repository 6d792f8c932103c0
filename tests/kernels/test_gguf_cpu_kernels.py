"""The GGUF CPU matmul kernels (kernels/gguf_cpu.cpp via kernels/gguf_ops.py) against float64 references, on every
instruction-set version this machine can run.

Two references per case, from the `gguf` package's dequantizer:
- tight: the activations int8-quantized exactly as the kernels do (per block, d = max|x| / 127, q = rint(x * (127 /
  max|x|)) in float32), then a float64 matmul. The kernels' integer dot products are exact, so what remains is float32
  rounding of the per-block scales and partial sums: well under 1e-6 of sum_k |x_k| |W_nk|, with the unsigned
  weights' offsets (up to 2x |W| for Q4_0's -8) counted in.
- loose: the exact float64 x @ W^T. Rounding x to int8 moves each value by at most half a step, max|x_block| / 254,
  so |y - exact| <= sum_blocks max|x_block| / 254 * sum_{k in block} |W_nk|, a bound the test checks per element.

The float-activation mode (`activations="float"`) dequantizes the weights exactly and sums in float32, so it is
checked against the exact float64 x @ W^T to float32 summation rounding: 2e-6 of sum_k |x_k| |W_nk|.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import quants as gguf_quants

from tests.helpers.gguf_kernels import Q, check, check_float, needs_kernels, random_blocks
from tokenmill.kernels import cpu_ops, gguf_ops

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
BATCHES = [1, 2, 3, 7, 32, 64]


@pytest.fixture(params=gguf_ops.available_isas() or ["none"])
def isa(request):
    gguf_ops.set_isa(request.param)
    yield request.param
    gguf_ops.set_isa(None)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_batch_matches_the_references(qtype, isa):
    rng = np.random.default_rng(int(qtype))
    block_elems = GGML_QUANT_SIZES[qtype][0]
    n, k = 37, 3 * block_elems  # 37 rows: not a whole number of 4- or 16-row tiles
    blocks = random_blocks(qtype, n, k, rng)
    assert gguf_ops.isa() == isa
    for batch in BATCHES:
        x = torch.from_numpy(rng.standard_normal((batch, k)).astype(np.float32))
        x[0, :block_elems] = 0.0  # an all-zero activation block (scale 0) in every batch
        y = gguf_ops.gguf_matmul(x, torch.from_numpy(blocks), int(qtype), n, k, activations="int8")
        assert y.shape == (batch, n) and y.dtype == torch.float32
        check(x, blocks, qtype, y)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda t: t.name)
def test_weights_quantized_by_gguf(qtype, isa):
    """Blocks from the gguf package's own quantizer (real layouts), on a wider matrix."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((70, 320)).astype(np.float32) * 0.05
    blocks = gguf_quants.quantize(w, qtype)
    x = torch.from_numpy(rng.standard_normal((5, 320)).astype(np.float32))
    check(x, blocks, qtype, gguf_ops.gguf_matmul(x, torch.from_numpy(blocks), int(qtype), 70, 320, activations="int8"))
    check_float(
        x, blocks, qtype, gguf_ops.gguf_matmul(x, torch.from_numpy(blocks), int(qtype), 70, 320, activations="float")
    )


@needs_kernels
def test_bfloat16_in_and_out_and_strided_rows():
    rng = np.random.default_rng(3)
    qtype = Q.Q4_K
    blocks = torch.from_numpy(random_blocks(qtype, 19, 512, rng))
    wide = torch.from_numpy(rng.standard_normal((6, 700)).astype(np.float32))
    x = wide[:, 100:612]  # rows 700 apart
    for mode, checker in (("int8", check), ("float", check_float)):
        y = gguf_ops.gguf_matmul(x, blocks, int(qtype), 19, 512, activations=mode)
        checker(x.contiguous(), blocks.numpy(), qtype, y)
        xb = x.to(torch.bfloat16)
        yb = gguf_ops.gguf_matmul(xb, blocks, int(qtype), 19, 512, activations=mode)
        assert yb.dtype == torch.bfloat16
        expected = gguf_ops.gguf_matmul(xb.float(), blocks, int(qtype), 19, 512, activations=mode)
        torch.testing.assert_close(yb, expected.to(torch.bfloat16), rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_float_activations_match_the_float64_product(qtype, isa):
    rng = np.random.default_rng(100 + int(qtype))
    block_elems = GGML_QUANT_SIZES[qtype][0]
    n, k = 37, (3 if block_elems == 256 else 9) * block_elems  # an odd number of blocks: the unpaired last block
    blocks = random_blocks(qtype, n, k, rng)
    assert gguf_ops.isa() == isa
    for batch in BATCHES:
        x = torch.from_numpy(rng.standard_normal((batch, k)).astype(np.float32))
        y = gguf_ops.gguf_matmul(x, torch.from_numpy(blocks), int(qtype), n, k, activations="float")
        assert y.shape == (batch, n) and y.dtype == torch.float32
        check_float(x, blocks, qtype, y)
        # far closer than the int8 activations get: their rounding shows at this tolerance
        y8 = gguf_ops.gguf_matmul(x, torch.from_numpy(blocks), int(qtype), n, k, activations="int8")
        assert not np.allclose(y8.numpy(), y.numpy(), rtol=1e-5, atol=0)


# The types whose plain kernel sums each activation row's blocks in one order whatever the batch (Q4_0 / Q4_1 / Q8_0
# take the repacked kernel for that; their plain x86 kernel has a one-row variant of its own).
BATCH_INVARIANT_TYPES = [Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@needs_kernels
@pytest.mark.parametrize("qtype", BATCH_INVARIANT_TYPES, ids=lambda t: t.name)
def test_a_token_gets_the_same_bits_at_every_batch_size(qtype, isa):
    """A token's outputs alone, among 3 and among 11 (full and partial 4-row passes), bit for bit: a speculative
    token verified in a batch matches its one-token decode."""
    rng = np.random.default_rng(60 + int(qtype))
    n, k = 21, 3 * GGML_QUANT_SIZES[qtype][0]  # an odd block count: the unpaired last block of the 32-wide types
    blocks = torch.from_numpy(random_blocks(qtype, n, k, rng))
    x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32))
    batch = gguf_ops.gguf_matmul(x, blocks, int(qtype), n, k, activations="int8")
    for t in range(11):
        alone = gguf_ops.gguf_matmul(x[t : t + 1], blocks, int(qtype), n, k, activations="int8")
        assert torch.equal(alone[0], batch[t]), f"{qtype.name} token {t} differs alone and in a batch of 11"
    assert torch.equal(gguf_ops.gguf_matmul(x[4:7], blocks, int(qtype), n, k, activations="int8"), batch[4:7])


def test_activation_mode_choice(monkeypatch):
    assert gguf_ops.DEFAULT_ACTIVATIONS in gguf_ops.ACTIVATION_MODES
    monkeypatch.setenv("TOKENMILL_GGUF_ACTIVATIONS", "int8")
    assert gguf_ops._default_activations() == "int8"
    monkeypatch.setenv("TOKENMILL_GGUF_ACTIVATIONS", "fp8")
    with pytest.raises(ValueError, match="TOKENMILL_GGUF_ACTIVATIONS must be one of"):
        gguf_ops._default_activations()
    with pytest.raises(ValueError, match="activations must be one of"):
        gguf_ops.gguf_matmul(
            torch.zeros((1, 32)), torch.zeros((4, 18), dtype=torch.uint8), int(Q.Q4_0), 4, 32, activations="half"
        )


def test_dequantize_rows_is_the_gguf_reference():
    rng = np.random.default_rng(5)
    blocks = random_blocks(Q.Q6_K, 4, 512, rng)
    w = gguf_ops.dequantize_rows(torch.from_numpy(blocks), int(Q.Q6_K), 4, 512)
    assert w.dtype == torch.float32 and w.shape == (4, 512)
    np.testing.assert_array_equal(w.numpy(), gguf_quants.dequantize(blocks, Q.Q6_K).astype(np.float32))


def test_supported_types_and_bad_input():
    assert gguf_ops.SUPPORTED_TYPES == frozenset(int(t) for t in TYPES)
    blocks = torch.zeros((4, 18 * 2), dtype=torch.uint8)
    x = torch.zeros((1, 64))
    with pytest.raises(ValueError, match="qtype 1"):
        gguf_ops.gguf_matmul(x, blocks, 1, 4, 64)  # F16 is not a block type here
    with pytest.raises(ValueError, match="blocks must be a uint8 CPU tensor of shape \\(5, 36\\)"):
        gguf_ops.gguf_matmul(x, blocks, int(Q.Q4_0), 5, 64)
    with pytest.raises(ValueError, match="not a multiple of Q4_K's block of 256"):
        gguf_ops.gguf_matmul(torch.zeros((1, 576)), torch.zeros((4, 324), dtype=torch.uint8), int(Q.Q4_K), 4, 576)
    with pytest.raises(ValueError, match="CPU tensor \\[T, 64\\], got torch.float32 \\(1, 32\\)"):
        gguf_ops.gguf_matmul(torch.zeros((1, 32)), blocks, int(Q.Q4_0), 4, 64)
    with pytest.raises(ValueError, match="got torch.float64"):
        gguf_ops.gguf_matmul(x.double(), blocks, int(Q.Q4_0), 4, 64)


@needs_kernels
def test_instruction_set_choice():
    available = gguf_ops.available_isas()
    assert "scalar" in available
    best = gguf_ops.isa()
    assert best == [name for name in ("avx512", "avx2", "neon", "scalar") if name in available][0]
    try:
        gguf_ops.set_isa("scalar")
        assert gguf_ops.isa() == "scalar"
        missing = [name for name in gguf_ops.ISA_CODES if name not in available]
        for name in missing:
            with pytest.raises(ValueError, match="not available here"):
                gguf_ops.set_isa(name)
    finally:
        gguf_ops.set_isa(None)
    assert gguf_ops.isa() == best


@needs_kernels
def test_the_environment_variable_forces_a_version(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "scalar")
    gguf_ops.library.cache_clear()
    try:
        assert gguf_ops.isa() == "scalar"
    finally:
        monkeypatch.undo()
        gguf_ops.library.cache_clear()
        gguf_ops.set_isa(None)
    assert gguf_ops.isa() != "scalar" or gguf_ops.available_isas() == ["scalar"]


def test_built_as_its_own_cached_library():
    name = cpu_ops.library_name("g++", gguf_ops.SOURCE, gguf_ops.build_flags())
    assert name.startswith("gguf_cpu-") and name != cpu_ops.library_name("g++")


def test_without_kernels_the_fallback_dequantizes(monkeypatch, caplog):
    rng = np.random.default_rng(11)
    blocks = random_blocks(Q.Q5_K, 9, 256, rng)
    x = torch.from_numpy(rng.standard_normal((3, 256)).astype(np.float32))
    monkeypatch.setattr(gguf_ops, "library", lambda: None)
    gguf_ops._log_fallback_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tokenmill.kernels.gguf_ops"):
        y = gguf_ops.gguf_matmul(x, torch.from_numpy(blocks), int(Q.Q5_K), 9, 256)
        gguf_ops.gguf_matmul(x, torch.from_numpy(blocks), int(Q.Q5_K), 9, 256)
    assert caplog.text.count("dequantizing the weights") == 1
    assert gguf_ops.isa() == "torch"
    w = gguf_quants.dequantize(blocks, Q.Q5_K).astype(np.float64)
    np.testing.assert_allclose(y.double().numpy(), x.double().numpy() @ w.T, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(
    not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
    reason="needs an AArch64 cross compiler and qemu-aarch64 to run the NEON version",
)
@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+dotprod"])
def test_neon_version_matches_portable_under_qemu(tmp_path, march):
    check = Path(__file__).with_name("gguf_neon_check.cpp")
    binary = tmp_path / "check"
    built = subprocess.run(
        [
            "aarch64-linux-gnu-g++",
            "-static",
            "-O1",
            f"-march={march}",
            "-fno-trapping-math",
            "-fopenmp",
            "-std=c++17",
            f"-I{gguf_ops.SOURCE.parent}",
            str(check),
            "-o",
            str(binary),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    ran = subprocess.run(
        ["qemu-aarch64", "-cpu", "max", str(binary)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert ran.returncode == 0 and "failures 0" in ran.stdout and "active isa 1" in ran.stdout, ran.stdout
