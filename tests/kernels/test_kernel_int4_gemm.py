"""The AWQ/GPTQ int4 GEMM against a float64 reference built from the test quantizer's own codes (not from the
kernel module's unpacking): odd N and K (multiples of the packing, not of the tiles), batches 1..64, act-order with
a shuffled g_idx, zero points on and off, GPTQ v1 and v2, group sizes from 24 to one group."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.quantized_checkpoints import awq_tensors, gptq_tensors, quantize_int4
from tokenmill.kernels import int4_gemm as int4_module
from tokenmill.kernels.int4_gemm import (
    awq_dequantize_ref,
    awq_gemm,
    gptq_dequantize_ref,
    gptq_gemm,
    pack_int4,
    unpack_int4,
)

TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cases are built on the CPU, the kernel runs here


def on_device(tensors: dict) -> dict:
    return {name: tensor.to(DEVICE) for name, tensor in tensors.items()}


def make_case(n, k, group_size, rows, dtype, sym=False, act_order=False, seed=0):
    """(quantized weight on the CPU, x on DEVICE, the exact float64 product on the CPU)."""
    with torch.device("cpu"):
        g = torch.Generator().manual_seed(seed)
        weight = torch.randn(n, k, generator=g, dtype=torch.float64) / k**0.5
        perm = torch.randperm(k, generator=g) if act_order else None
        q = quantize_int4(weight, group_size, sym=sym, perm=perm, min_zero=1)
        x = torch.randn(rows, k, generator=g, dtype=torch.float64).to(dtype)
    return q, x.to(DEVICE), x.double() @ q.dense().T  # the product of the rounded input and the quantized weight


@pytest.mark.parametrize(
    "n, k, group_size, rows, dtype, zero_point",
    [
        (200, 256, 128, 1, torch.float16, True),  # a decode row; N not a multiple of the 64-column tile
        (72, 96, 32, 33, torch.bfloat16, True),  # three row tiles of 16 in a 64-row block, K not a multiple of 64
        (136, 128, -1, 5, torch.float16, False),  # one group; no zero points (codes offset by 8)
        (64, 120, 40, 64, torch.float32, True),  # a group size no tile divides: scales gathered per element
    ],
)
def test_awq_gemm_matches_float64_reference(n, k, group_size, rows, dtype, zero_point):
    q, x, expected = make_case(n, k, group_size, rows, dtype, sym=not zero_point, seed=n + rows)
    t = on_device(awq_tensors(q, zero_point=zero_point))
    assert t["qweight"].shape == (k, n // 8) and t["scales"].shape == (q.scales.shape[0], n)
    dense = awq_dequantize_ref(t["qweight"], t.get("qzeros"), t["scales"], group_size)
    torch.testing.assert_close(dense.cpu(), q.dense().T, rtol=0, atol=0)  # the reference unpacks AWQ's order right
    got = awq_gemm(x, t["qweight"], t.get("qzeros"), t["scales"], group_size)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.double().cpu(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize(
    "n, k, group_size, rows, dtype, sym, act_order, zero_offset",
    [
        (200, 256, 128, 7, torch.float16, False, False, 1),  # v1, asymmetric
        (72, 192, 64, 17, torch.bfloat16, False, True, 1),  # act-order: a shuffled g_idx
        (72, 160, 32, 1, torch.float16, True, True, 1),  # symmetric act-order decode
        (64, 120, 24, 3, torch.float32, False, False, 0),  # v2 zero points; a group size no tile divides
    ],
)
def test_gptq_gemm_matches_float64_reference(n, k, group_size, rows, dtype, sym, act_order, zero_offset):
    q, x, expected = make_case(n, k, group_size, rows, dtype, sym=sym, act_order=act_order, seed=k + rows)
    t = on_device(gptq_tensors(q, zero_offset=zero_offset))
    g_idx = t["g_idx"] if act_order else None
    assert t["qweight"].shape == (k // 8, n) and t["qzeros"].shape == (k // group_size, n // 8)
    dense = gptq_dequantize_ref(t["qweight"], t["qzeros"], t["scales"], group_size, t["g_idx"], zero_offset)
    torch.testing.assert_close(dense.cpu(), q.dense().T, rtol=0, atol=0)
    got = gptq_gemm(x, t["qweight"], t["qzeros"], t["scales"], group_size, g_idx, zero_offset)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.double().cpu(), expected, **TOLERANCES[dtype])


def test_act_order_g_idx_is_read():
    """The same codes with the plain g_idx give a different product: the shuffled one is really used."""
    q, x, expected = make_case(64, 128, 32, 2, torch.float32, act_order=True, seed=5)
    t = on_device(gptq_tensors(q))
    plain = gptq_gemm(x, t["qweight"], t["qzeros"], t["scales"], 32, None)
    assert (plain.double().cpu() - expected).abs().max() > 1e-2
    torch.testing.assert_close(
        gptq_gemm(x, t["qweight"], t["qzeros"], t["scales"], 32, t["g_idx"]).double().cpu(),
        expected,
        atol=1e-4,
        rtol=1e-4,
    )


def test_packing_round_trips_and_awq_order():
    codes = torch.randint(0, 16, (24, 16))
    for order in (int4_module.AWQ_ORDER, int4_module.PLAIN_ORDER):
        assert torch.equal(unpack_int4(pack_int4(codes, 1, order), 1, order).long(), codes)
    assert torch.equal(unpack_int4(pack_int4(codes, 0), 0).long(), codes)
    # AutoAWQ: nibble j of each int32 holds column AWQ_ORDER[j]
    row = torch.arange(8)[None, :]
    packed = int(pack_int4(row, 1, int4_module.AWQ_ORDER)[0, 0])
    assert [(packed >> (4 * j)) & 0xF for j in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(3, 12, dtype=torch.long), 1)


def test_three_dim_input_and_empty_batch():
    q, x, expected = make_case(64, 64, 32, 6, torch.float32, seed=1)
    t = on_device(awq_tensors(q))
    got = awq_gemm(x.reshape(2, 3, 64), t["qweight"], t["qzeros"], t["scales"], 32)
    torch.testing.assert_close(got.reshape(6, 64).double().cpu(), expected, atol=1e-4, rtol=1e-4)
    assert awq_gemm(x[:0], t["qweight"], t["qzeros"], t["scales"], 32).shape == (0, 64)
    with pytest.raises(ValueError, match="group_size=48 does not divide"):
        awq_gemm(x, t["qweight"], t["qzeros"], t["scales"], 48)


def test_sliced_and_fused_weights_feed_the_kernel():
    """What the layers hand the kernel after `rows` (unaligned: repacked), `cols` and `concat_rows`."""
    from tokenmill.workers.quantization.awq import AWQWeight
    from tokenmill.workers.quantization.base import fuse_rows
    from tokenmill.workers.quantization.gptq import GPTQWeight

    q, x, _ = make_case(64, 128, 32, 3, torch.float32, act_order=True, seed=9)
    t = on_device(awq_tensors(q))
    awq = AWQWeight(t["qweight"], t["qzeros"], t["scales"], 32)
    t = on_device(gptq_tensors(q))
    gptq = GPTQWeight(t["qweight"], t["qzeros"], t["scales"], 32, t["g_idx"])
    for weight in (
        fuse_rows([awq.rows(4, 16), awq.rows(32, 32)]).cols(32, 64),
        fuse_rows([gptq.rows(4, 16), gptq.rows(32, 32)]).cols(40, 48),
    ):
        if isinstance(weight, AWQWeight):
            got = awq_gemm(x[:, 32:96], weight.qweight, weight.qzeros, weight.scales, weight.group_size)
            inputs = x[:, 32:96]
        else:
            got = gptq_gemm(
                x[:, 40:88],
                weight.qweight,
                weight.qzeros,
                weight.scales,
                weight.group_size,
                weight.g_idx,
                weight.zero_offset,
            )
            inputs = x[:, 40:88]
        assert got.shape == (3, 48)
        torch.testing.assert_close(
            got.double(), inputs.double() @ weight.dequantize(torch.float64).T, atol=1e-4, rtol=1e-4
        )


_COMPILE_SCRIPT = """
from triton.backends.compiler import GPUTarget
from tests.kernels.cuda_compile_check import TYPES, compile_kernel
from tokenmill.kernels import fp8_gemm, int4_gemm

for capability in (80, 90):
    target = GPUTarget("cuda", capability, 32)
    for dtype, awq, zeros, g_idx, per_tile in [("fp16", True, True, False, True), ("bf16", False, True, True, False),
                                               ("fp32", True, False, False, False)]:
        pointers = {"x_ptr": TYPES[dtype], "out_ptr": TYPES[dtype], "qweight_ptr": "*i32", "qzeros_ptr": "*i32",
                    "scales_ptr": "*fp16", "g_idx_ptr": "*i32"}
        constexprs = dict(AWQ=awq, HAS_ZEROS=zeros, HAS_G_IDX=g_idx, ZERO_OFFSET=0 if awq else 1,
                          GROUP_PER_TILE=per_tile, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE_DOT=dtype == "fp32")
        assert compile_kernel(int4_gemm._int4_gemm_kernel, target, pointers, constexprs).asm.get("cubin")
        print(f"sm_{capability} int4 awq={awq} {dtype}: ok")
    # W8A8 needs fp8 tensor cores (sm_89+); the weight-only path reads the e4m3 bits as uint8 on any GPU
    for dtype, fp8_dot in [("bf16", False)] + ([("fp32", False), ("bf16", True)] if capability >= 89 else []):
        pointers = {"x_ptr": "*fp8e4nv" if fp8_dot else TYPES[dtype], "x_scale_ptr": "*fp32",
                    "w_ptr": "*fp8e4nv" if fp8_dot else "*u8", "w_scale_ptr": "*fp32", "out_ptr": TYPES[dtype]}
        constexprs = dict(FP8_DOT=fp8_dot, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE_DOT=dtype == "fp32")
        assert compile_kernel(fp8_gemm._fp8_gemm_kernel, target, pointers, constexprs).asm.get("cubin")
        print(f"sm_{capability} fp8 dot={fp8_dot} {dtype}: ok")
"""


def test_int4_and_fp8_gemm_compile_for_nvidia_targets():
    """The interpreter accepts what the GPU compiler may not: compile both kernels to cubins (no GPU needed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300, cwd=repo_root
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok") == 6 + 4, result.stdout
