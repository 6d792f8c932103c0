"""oneDNN linear layers on CPU: packed weights compute what F.linear computes, and the runner packs the right ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.runner_driver import make_runner
from tokenmill.workers.models.layers import GateUpLinear, LMHead, QKVLinear, RowParallelLinear
from tokenmill.workers.models.packed_linear import can_pack, linear, packed

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_weight_matches_f_linear(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 40, generator=generator)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
    weight_packed = packed(weight)
    assert weight_packed.is_mkldnn and weight_packed.shape == weight.shape
    torch.testing.assert_close(linear(x, weight_packed, bias), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x, weight, bias), expected, atol=1e-5, rtol=1e-5)  # dense, through oneDNN
    # a strided input (a view of a wider activation), as the layers pass
    wide = torch.randn(rows, 80, generator=generator)
    torch.testing.assert_close(
        linear(wide[:, ::2], weight_packed, bias), linear(wide[:, ::2].contiguous(), weight, bias)
    )


def test_only_cpu_float32_and_native_bfloat16_are_packed():
    assert can_pack(torch.zeros(4, 4))
    assert not can_pack(torch.zeros(4, 4, dtype=torch.float16))
    assert can_pack(torch.zeros(4, 4, dtype=torch.bfloat16)) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not can_pack(packed(torch.zeros(4, 4)))  # already packed


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen3", True)])
def test_runner_packs_every_matmul_and_a_copy_of_a_tied_lm_head(tiny_checkpoint, arch, tied):
    path, hf_model = tiny_checkpoint(arch)
    model = make_runner(path).model
    linears = [m for m in model.modules() if isinstance(m, (QKVLinear, GateUpLinear, RowParallelLinear))]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    head = next(m for m in model.modules() if isinstance(m, LMHead))
    assert head.tied == tied
    assert head.weight.is_mkldnn == (not tied)
    assert not model.model.embed_tokens.weight.is_mkldnn  # the lookup table stays dense
    if tied:
        assert head.weight is model.model.embed_tokens.weight
        assert head.packed_tied_weight.is_mkldnn
        hidden = torch.randn(5, hf_model.config.hidden_size)
        torch.testing.assert_close(
            head(hidden), hidden @ hf_model.get_output_embeddings().weight.T, atol=1e-5, rtol=1e-5
        )
