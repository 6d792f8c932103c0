"""The repacked GGUF layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K with 8 rows interleaved:
kernels/gguf_ops.py matmul kernel, on every instruction-set version this machine can run.

The layout is a byte permutation within each group of 8 rows (Q5_0 / Q5_1's words of fifth bits also transposed,
Q3_K's hmask and quants recoded as 3-bit values), so it must round-trip exactly and dequantize to the plain blocks'
weights. The kernel takes the same integer dot products as the plain one with the same int8 activations; only the
float summation order differs, so it must match both the plain kernel and the float64 int8-activation reference
(`check` of test_gguf_cpu_kernels) to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from tests.helpers.gguf_kernels import check, check_float, needs_kernels, random_blocks
from tokenmill.kernels import gguf_ops

Q = GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K]
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K)  # 256-wide blocks


def blocks_of(qtype: GGMLQuantizationType, count: int) -> int:
    """The width of `count` blocks of this type."""
    return count * GGML_QUANT_SIZES[qtype][0]


@pytest.fixture(params=gguf_ops.available_isas() or ["none"])
def isa(request):
    gguf_ops.set_isa(request.param)
    yield request.param
    gguf_ops.set_isa(None)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [8, 13, 37])
def test_layout_round_trips_and_dequantizes_as_the_plain_blocks(qtype, rows):
    rng = np.random.default_rng(rows)
    k = blocks_of(qtype, 3)
    plain = torch.from_numpy(random_blocks(qtype, rows, k, rng))
    packed = gguf_ops.repack_rows(plain, int(qtype), rows, k)
    # the numpy reference (a byte permutation per group) and the compiled byte moves agree
    assert torch.equal(gguf_ops.repack_rows(plain, int(qtype), rows, k, numpy=True), packed)
    whole = rows // 8 * 8
    assert packed.shape == plain.shape and packed.dtype == torch.uint8
    assert not torch.equal(packed[:whole], plain[:whole])
    assert torch.equal(packed[whole:], plain[whole:])  # the rows past the last group of 8 stay plain
    group_bytes = 8 * plain.shape[1]
    moved = packed if qtype not in RECODED else with_plain_bits(packed, qtype, rows)
    for g in range(rows // 8):  # each group holds its own 8 rows' bytes, moved
        span = slice(g * group_bytes, (g + 1) * group_bytes)
        assert torch.equal(moved.reshape(-1)[span].sort().values, plain.reshape(-1)[span].sort().values)
    # the fp16 scales of a group's first block come first, row by row (the layout the kernel reads)
    first = gguf_ops._PACKED_SEGMENTS[int(qtype)][0][0]
    assert torch.equal(packed[0, :16].reshape(8, 2), plain[:8, first : first + 2])
    assert torch.equal(gguf_ops.unpack_rows(packed, int(qtype), rows, k), plain)
    expected = gguf_quants.dequantize(plain.numpy(), qtype).reshape(rows, k)
    np.testing.assert_array_equal(
        gguf_ops.dequantize_rows(packed, int(qtype), rows, k, repacked=True).numpy(), expected.astype(np.float32)
    )
    ids = torch.tensor([rows - 1, 0, 5, rows - 1, rows // 2])
    for numpy in (False, True):
        assert torch.equal(gguf_ops.gather_rows(packed, int(qtype), k, ids, repacked=True, numpy=numpy), plain[ids])
        for bad in (rows, -1):
            with pytest.raises(IndexError, match="out of range"):
                gguf_ops.gather_rows(packed, int(qtype), k, torch.tensor([0, bad]), repacked=True, numpy=numpy)
    assert torch.equal(gguf_ops.gather_rows(plain, int(qtype), k, ids), plain[ids])


def transposed_word(word: int) -> list[int]:
    """The 4 bytes the repacked layout keeps for a plain Q5 word of fifth bits: bit j of byte i is element 4j + i's
    fifth bit, bit 4 + j element 16 + 4j + i's."""
    bit = [(word >> e) & 1 for e in range(32)]
    return [sum(bit[4 * j + i] << j | bit[16 + 4 * j + i] << (4 + j) for j in range(4)) for i in range(4)]


def plain_word(stored: list[int]) -> int:
    """`transposed_word`'s inverse."""
    word = 0
    for i in range(4):
        for j in range(4):
            word |= ((stored[i] >> j) & 1) << (4 * j + i) | ((stored[i] >> (4 + j)) & 1) << (16 + 4 * j + i)
    return word


def q3_k_values(block: list[int]) -> list[int]:
    """q + 4 in [0, 8) for each of a plain Q3_K block's 256 elements (ggml's layout: element 128 n + 32 f + l's two
    low bits at bits 2f, 2f + 1 of quant byte 32 + 32 n + l, its third at bit 4 n + f of hmask byte l)."""
    out = []
    for e in range(256):
        n, f, pos = e // 128, e % 128 // 32, e % 32
        out.append((block[32 + 32 * n + pos] >> (2 * f)) & 3 | ((block[pos] >> (4 * n + f)) & 1) << 2)
    return out


def q3_k_stored(values: list[int]) -> list[int]:
    """The 96 bytes the repacked layout keeps for a Q3_K block's values: for l = 4 i + k and u_v the value of element
    128 (v // 4) + 32 (v % 4) + l, bytes 12 i + k, 12 i + 4 + k, 12 i + 8 + k are u_0 | u_1 << 3 | (u_2 & 3) << 6,
    u_3 | u_4 << 3 | (u_5 & 3) << 6 and u_6 | u_7 << 3 | (u_2 >> 2) << 6 | (u_5 >> 2) << 7."""
    out = [0] * 96
    for pos in range(32):
        u = [values[128 * (v // 4) + 32 * (v % 4) + pos] for v in range(8)]
        at = 12 * (pos // 4) + pos % 4
        out[at] = u[0] | u[1] << 3 | (u[2] & 3) << 6
        out[at + 4] = u[3] | u[4] << 3 | (u[5] & 3) << 6
        out[at + 8] = u[6] | u[7] << 3 | (u[2] >> 2) << 6 | (u[5] >> 2) << 7
    return out


def q3_k_plain(stored: list[int]) -> list[int]:
    """`q3_k_stored` of `q3_k_values`' inverse: the plain block's 32 hmask and 64 quant bytes."""
    plain = [0] * 96
    for pos in range(32):
        a, b, c = (stored[12 * (pos // 4) + 4 * j + pos % 4] for j in range(3))
        u = [a & 7, a >> 3 & 7, a >> 6 | (c >> 4 & 4), b & 7, b >> 3 & 7, b >> 6 | (c >> 5 & 4), c & 7, c >> 3 & 7]
        for v in range(8):
            plain[32 + 32 * (v // 4) + pos] |= (u[v] & 3) << (2 * (v % 4))
            plain[pos] |= (u[v] >> 2) << v
    return plain


# The types whose repacked blocks keep some of a row's bytes recoded: (offset and length in the plain block, where
# the 8 rows' first 4-byte pieces of them start in the group block: piece p of row r at start + 32 p + 4 r), and the
# plain bytes from the stored ones.
RECODED = {Q.Q5_0: (2, 4, 16), Q.Q5_1: (4, 4, 32), Q.Q3_K: (0, 96, 112)}


def plain_word_bytes(stored: list[int]) -> list[int]:
    return list(plain_word(stored).to_bytes(4, "little"))


PLAIN_BYTES = {Q.Q5_0: plain_word_bytes, Q.Q5_1: plain_word_bytes, Q.Q3_K: q3_k_plain}


def stored_positions(qtype: GGMLQuantizationType, r: int) -> list[int]:
    """Where row r's recoded bytes sit in a group block, in their order."""
    _, length, start = RECODED[qtype]
    return [start + 32 * p + 4 * r + i for p in range(length // 4) for i in range(4)]


def with_plain_bits(packed: torch.Tensor, qtype: GGMLQuantizationType, rows: int) -> torch.Tensor:
    """The repacked bytes with each group block's recoded bytes put back in the plain order."""
    out = packed.clone()
    group_blocks = out[: rows // 8 * 8].reshape(-1, 8 * GGML_QUANT_SIZES[qtype][1])
    for g in range(group_blocks.shape[0]):
        for r in range(8):
            at = stored_positions(qtype, r)
            group_blocks[g, at] = torch.tensor(PLAIN_BYTES[qtype](group_blocks[g, at].tolist()), dtype=torch.uint8)
    return out


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_the_words_of_fifth_bits_are_stored_transposed(qtype):
    """Byte i of a row's stored word lines up with byte i of each 4-byte group of its quants (elements 4j + i and
    16 + 4j + i), which is what lets the kernels take group j's fifth bits with one shift and mask."""
    rng = np.random.default_rng(3)
    for word in [0, 1, 1 << 31, 0xFFFFFFFF, *rng.integers(0, 1 << 32, 50).tolist()]:
        assert plain_word(transposed_word(word)) == word
    k = blocks_of(qtype, 2)
    plain = torch.from_numpy(random_blocks(qtype, 8, k, rng))
    block, at = GGML_QUANT_SIZES[qtype][1], RECODED[qtype][0]
    for numpy in (False, True):
        packed = gguf_ops.repack_rows(plain, int(qtype), 8, k, numpy=numpy).reshape(-1, 8 * block)
        for b in range(2):
            for r in range(8):
                word = int.from_bytes(bytes(plain[r, b * block + at : b * block + at + 4].tolist()), "little")
                assert packed[b, stored_positions(qtype, r)].tolist() == transposed_word(word)


def test_q3_k_values_are_stored_as_3_bit_fields():
    """Each 32-byte vector of a packed Q3_K block holds three values per byte, so the kernel takes a value for 8 rows
    with one to five ops instead of five from ggml's separate planes of low and third bits."""
    rng = np.random.default_rng(5)
    k = blocks_of(Q.Q3_K, 2)
    plain = torch.from_numpy(random_blocks(Q.Q3_K, 8, k, rng))
    for numpy in (False, True):
        packed = gguf_ops.repack_rows(plain, int(Q.Q3_K), 8, k, numpy=numpy).reshape(-1, 8 * 110)
        for b in range(2):
            for r in range(8):
                block = plain[r, b * 110 : (b + 1) * 110].tolist()
                stored = packed[b, stored_positions(Q.Q3_K, r)].tolist()
                assert stored == q3_k_stored(q3_k_values(block))
                assert q3_k_plain(stored) == block[:96]


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repacked_matmul_matches_the_plain_kernel_and_the_references(qtype, isa):
    rng = np.random.default_rng(20 + int(qtype))
    assert gguf_ops.isa() == isa
    # a 5-row plain tail; two whole groups of the model's width (the k-quants: of the MLP down projection's)
    for rows, k in ((37, blocks_of(qtype, 3)), (16, 1536 if qtype in K_QUANTS else 576)):
        blocks = random_blocks(qtype, rows, k, rng)
        plain = torch.from_numpy(blocks)
        packed = gguf_ops.repack_rows(plain, int(qtype), rows, k)
        w = gguf_quants.dequantize(blocks, qtype).astype(np.float64).reshape(rows, k)
        for batch in [*range(1, 10), 17]:  # every token count of the 8- and 4-row passes, and two passes plus one
            x = torch.from_numpy(rng.standard_normal((batch, k)).astype(np.float32))
            x[0, :32] = 0.0  # an all-zero activation block (scale 0)
            y = gguf_ops.gguf_matmul(x, packed, int(qtype), rows, k, activations="int8", repacked=True)
            assert y.shape == (batch, rows) and y.dtype == torch.float32
            check(x, blocks, qtype, y)
            y_plain = gguf_ops.gguf_matmul(x, plain, int(qtype), rows, k, activations="int8")
            magnitude = np.abs(x.double().numpy()) @ (2 * np.abs(w) + np.abs(w).max(axis=1, keepdims=True)).T
            np.testing.assert_array_less(
                np.abs(y.double().numpy() - y_plain.double().numpy()),
                1e-6 * magnitude,
                err_msg=f"{qtype.name} T={batch}: repacked differs from the plain kernel",
            )
        # the float-activation mode on the repacked layout: each group put back in the plain layout, then as there
        x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
        y = gguf_ops.gguf_matmul(x, packed, int(qtype), rows, k, activations="float", repacked=True)
        check_float(x, blocks, qtype, y)
        torch.testing.assert_close(
            y, gguf_ops.gguf_matmul(x, plain, int(qtype), rows, k, activations="float"), rtol=0, atol=0
        )


@needs_kernels
def test_repacked_matmul_over_threads_and_a_prefill_batch():
    """Enough weight bytes for the parallel loop (the plain tail rows as its last iteration), several groups per tile
    past 8 activation rows, bfloat16 in and out, the float mode."""
    rng = np.random.default_rng(4)
    qtype, rows, k = Q.Q8_0, 253, 256
    assert rows * gguf_ops.row_bytes(int(qtype), k) >= 1 << 16  # the kernels' threshold for a parallel loop
    blocks = random_blocks(qtype, rows, k, rng)
    packed = gguf_ops.repack_rows(torch.from_numpy(blocks), int(qtype), rows, k)
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    check(x, blocks, qtype, gguf_ops.gguf_matmul(x, packed, int(qtype), rows, k, repacked=True, activations="int8"))
    xb = x[:3].to(torch.bfloat16)
    yb = gguf_ops.gguf_matmul(xb, packed, int(qtype), rows, k, repacked=True, activations="int8")
    expected = gguf_ops.gguf_matmul(xb, torch.from_numpy(blocks), int(qtype), rows, k, activations="int8")
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), expected.float(), rtol=1e-2, atol=1e-2)
    y = gguf_ops.gguf_matmul(x[:6], packed, int(qtype), rows, k, repacked=True, activations="float")
    check_float(x[:6], blocks, qtype, y)


def test_repacking_choice_and_bad_input(monkeypatch):
    blocks = torch.from_numpy(random_blocks(Q.Q6_K, 8, 256, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="qtype 14 has no repacked layout"):
        gguf_ops.repack_rows(blocks, int(Q.Q6_K), 8, 256)
    with pytest.raises(ValueError, match="qtype 14 has no repacked layout"):
        gguf_ops.gguf_matmul(torch.zeros((1, 256)), blocks, int(Q.Q6_K), 8, 256, repacked=True)
    monkeypatch.setenv("TOKENMILL_GGUF_REPACK", "0")
    assert not gguf_ops.repack_enabled() and not gguf_ops.repack_wanted(int(Q.Q4_1), 64)
    monkeypatch.setenv("TOKENMILL_GGUF_REPACK", "yes")
    with pytest.raises(ValueError, match="TOKENMILL_GGUF_REPACK must be 0 or 1"):
        gguf_ops.repack_enabled()
    monkeypatch.setenv("TOKENMILL_GGUF_REPACK", "1")
    fast = gguf_ops.isa() in ("avx512", "avx2") and gguf_ops.DEFAULT_ACTIVATIONS == "int8"
    assert gguf_ops.repack_wanted(int(Q.Q4_1), 64) == fast
    assert not gguf_ops.repack_wanted(int(Q.Q4_1), 7)  # no whole group of 8 rows
    assert not gguf_ops.repack_wanted(int(Q.Q6_K), 64)
    if "scalar" in gguf_ops.available_isas():
        try:
            gguf_ops.set_isa("scalar")  # the portable version runs the layout but gains nothing from it
            assert not gguf_ops.repack_wanted(int(Q.Q4_1), 64)
        finally:
            gguf_ops.set_isa(None)


def test_every_repacked_type_has_the_block_size_the_kernel_assumes():
    for qtype in gguf_ops.REPACK_TYPES:
        assert GGML_QUANT_SIZES[Q(qtype)][0] == (256 if qtype in K_QUANTS else 32)
        assert sorted(gguf_ops._group_permutation(qtype)) == list(range(8 * GGML_QUANT_SIZES[Q(qtype)][1]))


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repacked_rows_are_batch_invariant(qtype, isa):
    """A token's outputs are the same bits whichever batch it is multiplied in (whole groups of 8 rows: the plain
    tail rows' kernel is not batch-invariant), so a verified speculative token matches its one-token decode."""
    rng = np.random.default_rng(40 + int(qtype))
    rows, k = 24, 1536 if qtype in K_QUANTS else 576
    packed = gguf_ops.repack_rows(torch.from_numpy(random_blocks(qtype, rows, k, rng)), int(qtype), rows, k)
    x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32))
    batch = gguf_ops.gguf_matmul(x, packed, int(qtype), rows, k, activations="int8", repacked=True)
    for t in range(11):
        alone = gguf_ops.gguf_matmul(x[t : t + 1], packed, int(qtype), rows, k, activations="int8", repacked=True)
        assert torch.equal(alone[0], batch[t]), f"{qtype.name} row {t} differs alone and in a batch of 11"
    middle = gguf_ops.gguf_matmul(x[3:8], packed, int(qtype), rows, k, activations="int8", repacked=True)
    assert torch.equal(middle, batch[3:8])
