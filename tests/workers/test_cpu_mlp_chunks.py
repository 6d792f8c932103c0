"""A long prompt's CPU MLP runs `CPU_MLP_TOKEN_CHUNK` tokens at a time (workers/models/llama.py): the same bits as
one pass on GGUF weights (kernels batch-invariant), float rounding on dense ones, and one pass where chunking would
change what runs (LoRA deltas index the whole step's tokens)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.helpers.gguf_kernels import needs_kernels, random_blocks
from tokenmill.workers.models import llama
from tokenmill.workers.models.layers import TensorParallel, set_weight
from tokenmill.workers.quantization.gguf import GGUFWeight

HIDDEN, FFN = 256, 512


def _mlp() -> llama.DecoderMLP:
    return llama.DecoderMLP(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=FFN), TensorParallel())


def _gguf_mlp(rng: np.random.Generator) -> llama.DecoderMLP:
    """gate/up in Q5_0 (repacked where the kernels want it), down in Q6_K (the plain kernel): a Q4_K_M file's mix."""
    mlp = _mlp()
    gate_up = GGUFWeight(torch.from_numpy(random_blocks(Q.Q5_0, 2 * FFN, HIDDEN, rng)), int(Q.Q5_0), 2 * FFN, HIDDEN)
    gate_up.pack_for_matmul()
    set_weight(mlp.gate_up_proj, gate_up)
    down = torch.from_numpy(random_blocks(Q.Q6_K, HIDDEN, FFN, rng))
    set_weight(mlp.down_proj, GGUFWeight(down, int(Q.Q6_K), HIDDEN, FFN))
    return mlp


def _passes(mlp: llama.DecoderMLP, x: torch.Tensor) -> list[int]:
    """The token counts of the gate/up passes `mlp(x)` makes."""
    seen: list[int] = []
    hook = mlp.gate_up_proj.register_forward_pre_hook(lambda _module, args: seen.append(args[0].shape[0]))
    try:
        mlp(x)
    finally:
        hook.remove()
    return seen


def _one_pass(mlp: llama.DecoderMLP, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(llama, "CPU_MLP_TOKEN_CHUNK", 1 << 30)
        return mlp(x)


@needs_kernels
def test_a_long_prompt_runs_in_chunks_with_the_same_bits_on_gguf_weights(monkeypatch):
    rng = np.random.default_rng(0)
    mlp = _gguf_mlp(rng)
    tokens = 2 * llama.CPU_MLP_TOKEN_CHUNK + 37
    x = torch.from_numpy(rng.standard_normal((tokens, HIDDEN)).astype(np.float32))
    chunk = llama.CPU_MLP_TOKEN_CHUNK
    assert _passes(mlp, x) == [chunk, chunk, 37]
    assert _passes(mlp, x[:chunk]) == [chunk]
    chunked = mlp(x)
    assert chunked.shape == (tokens, HIDDEN)
    assert torch.equal(chunked, _one_pass(mlp, x, monkeypatch))


def test_dense_weights_chunked_match_one_pass_and_lora_stays_whole(monkeypatch):
    torch.manual_seed(0)
    mlp = _mlp()
    for parameter in mlp.parameters():
        parameter.data.normal_(0.0, 0.05)
    x = torch.randn(llama.CPU_MLP_TOKEN_CHUNK + 5, HIDDEN)
    torch.testing.assert_close(mlp(x), _one_pass(mlp, x, monkeypatch), rtol=1e-5, atol=1e-6)
    mlp.gate_up_proj.lora = SimpleNamespace(add_to=lambda _x, _out: None)  # any adapter: the step's token order
    assert _passes(mlp, x) == [x.shape[0]]
