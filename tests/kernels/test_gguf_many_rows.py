"""The GGUF kernels at many activation rows (prefill chunks, batch-16 steps): Q6_K's 8-row unpacked kernel (AVX-512
VNNI, from 16 rows on; kernels/gguf_cpu.cpp `q6_k_tile_many`) on every instruction-set version this machine runs.

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

MANY_ROWS = 16  # the kernel's threshold (kQ6kManyRows)


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
    for batch in (MANY_ROWS - 1, MANY_ROWS, MANY_ROWS + 7, 40):
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
        among_others = _matmul(torch.cat([x[t : t + 1], x[:MANY_ROWS]]), blocks, rows, k)[0]
        assert torch.equal(among_others, batch[t]), f"row {t} differs in another batch of many rows"
    assert torch.equal(_matmul(x[8:32], blocks, rows, k), batch[8:32])
