"""The GGUF kernels at many activation rows (prefill chunks, batch-16 steps): Q6_K's 8-row unpacked kernel (x86: from
16 rows on with AVX-512 VNNI, 32 with AVX2; kernels/gguf_cpu.cpp `q6_k_tile_many`) on every instruction-set version
this machine runs.

It must give the int8-activation result (the float64 reference of tests/helpers/gguf_kernels.check), with plain
tail rows past the last whole group of 8, and a row's result must not depend on the other rows of a many-row batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.helpers.gguf_kernels import check, needs_kernels, random_blocks
from tokenmill.kernels import gguf_ops


def many_rows(isa: str) -> int:
    """The kernel's threshold (kQ6kManyRows; the portable versions have no such kernel)."""
    return 16 if isa == "avx512" else 32


@pytest.fixture(params=gguf_ops.available_isas() or ["none"])
def isa(request):
    gguf_ops.set_isa(request.param)
    yield request.param
    gguf_ops.set_isa(None)


def _matmul(x: torch.Tensor, blocks: np.ndarray, rows: int, k: int) -> torch.Tensor:
    return gguf_ops.gguf_matmul(x, torch.from_numpy(blocks), int(Q.Q6_K), rows, k, activations="int8")


@needs_kernels
@pytest.mark.parametrize("rows, k", [(37, 512), (64, 1536)])
def test_q6_k_at_many_rows_is_the_int8_result(rows, k, isa):
    """37 rows: two whole groups in the first 16-row tile, then 5 plain tail rows; 64: whole groups only."""
    rng = np.random.default_rng(rows)
    blocks = random_blocks(Q.Q6_K, rows, k, rng)
    many = many_rows(isa)
    for batch in (many - 1, many, many + 7, 40):
        x = torch.from_numpy(rng.standard_normal((batch, k)).astype(np.float32))
        x[1, :256] = 0.0  # an all-zero activation block (scale 0)
        y = _matmul(x, blocks, rows, k)
        assert y.shape == (batch, rows)
        check(x, blocks, Q.Q6_K, y)


@needs_kernels
def test_q6_k_many_row_results_do_not_depend_on_the_batch(isa):
    rng = np.random.default_rng(7)
    rows, k = 24, 768
    blocks = random_blocks(Q.Q6_K, rows, k, rng)
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    batch = _matmul(x, blocks, rows, k)
    for t in (0, 9, 17, 39):
        among_others = _matmul(torch.cat([x[t : t + 1], x[: many_rows(isa)]]), blocks, rows, k)[0]
        assert torch.equal(among_others, batch[t]), f"row {t} differs in another batch of many rows"
    assert torch.equal(_matmul(x[4:40], blocks, rows, k), batch[4:40])


# The repacked nibble kinds at prefill-sized batches (a Q4_K_M file's Q5_0 projections): packed_tile_rows
NIBBLE_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL]


def _repacked_matmul(x: torch.Tensor, packed: torch.Tensor, qtype: Q, rows: int, k: int) -> torch.Tensor:
    return gguf_ops.gguf_matmul(x, packed, int(qtype), rows, k, activations="int8", repacked=True)


@needs_kernels
@pytest.mark.parametrize("qtype", NIBBLE_TYPES, ids=lambda t: t.name)
def test_repacked_nibble_kinds_at_many_rows_are_the_decode_bits(qtype, isa):
    """40 groups of 8 rows (several tiles) and 5 plain tail rows; 37 activation rows (4 whole passes of 8 and a
    tail of 5): the int8 reference, and each whole-group row the same bits as that token multiplied alone."""
    rng = np.random.default_rng(50 + int(qtype))
    rows, k = 45, 896
    blocks = random_blocks(qtype, rows, k, rng)
    packed = gguf_ops.repack_rows(torch.from_numpy(blocks), int(qtype), rows, k)
    x = torch.from_numpy(rng.standard_normal((37, k)).astype(np.float32))
    x[2, :32] = 0.0  # an all-zero activation block (scale 0)
    batch = _repacked_matmul(x, packed, qtype, rows, k)
    check(x, blocks, qtype, batch)
    for t in (0, 2, 8, 33, 36):
        alone = _repacked_matmul(x[t : t + 1], packed, qtype, rows, k)[0]
        assert torch.equal(alone[:40], batch[t, :40]), f"{qtype.name} row {t} differs alone and among 37"
    assert torch.equal(_repacked_matmul(x[5:30], packed, qtype, rows, k)[:, :40], batch[5:30, :40])
