"""GGUF weights gathered onto huge pages (`workers/host_memory.py`): the same bytes at 2 MiB-aligned addresses, each
weight moved once, and the matmuls unchanged to the bit."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.workers.host_memory import ALIGNMENT, HUGE_PAGE, gather_gguf_weights, huge_page_bytes
from tokenmill.workers.quantization.gguf import GGUFWeight

Q8_0, Q4_1 = 8, 3


def random_weight(qtype: int, out_features: int, in_features: int, rng: np.random.Generator) -> GGUFWeight:
    block_bytes = {Q8_0: 34, Q4_1: 20}[qtype]
    blocks = rng.integers(0, 256, (out_features, in_features // 32, block_bytes), dtype=np.uint8)
    blocks[..., :2] = np.array([0.01], dtype=np.float16).view(np.uint8)  # finite scales
    if qtype == Q4_1:
        blocks[..., 2:4] = np.array([-0.05], dtype=np.float16).view(np.uint8)
    return GGUFWeight(torch.from_numpy(blocks.reshape(out_features, -1)), qtype, out_features, in_features)


def test_a_region_starts_on_a_huge_page():
    for nbytes in (1, 4096, 3 * HUGE_PAGE + 5):
        region = huge_page_bytes(nbytes)
        assert region.numel() == nbytes and region.data_ptr() % HUGE_PAGE == 0
        region.fill_(7)  # writable end to end
        assert int(region.sum()) == 7 * nbytes


def test_gguf_weights_move_into_one_region_with_their_bytes_and_products():
    rng = np.random.default_rng(0)
    shared = random_weight(Q8_0, 40, 64, rng)
    model = nn.ModuleDict(
        {"a": random_weight(Q4_1, 24, 96, rng), "b": shared, "tied": nn.ModuleDict({"again": shared})}
    )
    weights = [model["a"], shared]
    for weight in weights:
        weight.pack_for_matmul()
    before = [weight.blocks.clone() for weight in weights]
    x = {id(weight): torch.randn(3, weight.in_features) for weight in weights}
    expected = [weight.matmul(x[id(weight)]) for weight in weights]

    moved = gather_gguf_weights(model)

    assert moved == sum(block.numel() for block in before)  # the shared weight once
    first = weights[0].blocks.data_ptr()
    assert first % HUGE_PAGE == 0
    assert weights[1].blocks.data_ptr() == first + -(-before[0].numel() // ALIGNMENT) * ALIGNMENT
    for weight, old, product in zip(weights, before, expected, strict=True):
        assert torch.equal(weight.blocks, old)
        assert torch.equal(weight.matmul(x[id(weight)]), product)  # the kernel reads the new address, same bits


def test_a_model_without_gguf_weights_is_left_alone():
    assert gather_gguf_weights(nn.Linear(4, 4)) == 0
