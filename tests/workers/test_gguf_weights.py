"""GGUF weights kept quantized: `GGUFWeight`'s row/column slicing and fusing, the GGUF loader on a small file of mixed
block types (one the CPU kernels lack), and the layers that take quantized weights in place of dense ones."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tokenmill.config import ModelConfig
from tokenmill.workers.model_loader import iter_weights
from tokenmill.workers.models.layers import (
    GateUpLinear,
    LMHead,
    QKVLinear,
    RowParallelLinear,
    TensorParallel,
    VocabEmbedding,
)
from tokenmill.workers.quantization.base import StackedRows, fuse_rows
from tokenmill.workers.quantization.gguf import GGUFWeight


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid uint8 blocks `[rows, row_bytes]` of `qtype`: quantized random weights, or for the K-quants (which the
    gguf package cannot quantize) random bytes with their fp16 scales set to small finite values."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, (rows, cols // block_size, 2)).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:  # ..., d at the end
        blocks[..., -2:] = scales[..., 0:2]
    else:  # Q4_K / Q5_K: d, dmin first (IQ4_XS: d, then its high scale bits)
        blocks[..., 0:4] = scales.reshape(rows, cols // block_size, 4)
    return blocks.reshape(rows, -1)


def weight(qtype: T, rows: int, cols: int, seed: int = 0) -> GGUFWeight:
    return GGUFWeight(torch.from_numpy(random_blocks(qtype, rows, cols, seed)), qtype, rows, cols)


def reference(w: GGUFWeight) -> torch.Tensor:
    """The weight dequantized by the gguf package (independent of the kernels)."""
    dense = gguf.quants.dequantize(w.blocks.numpy(), T(w.qtype))
    return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))


def assert_matmul_close(w, dense: torch.Tensor, tokens: int = 5) -> None:
    x = torch.randn(tokens, dense.shape[1], generator=torch.Generator().manual_seed(1))
    expected = x.double() @ dense.double().T
    got = w.matmul(x)
    assert got.shape == (tokens, dense.shape[0]) and got.dtype == torch.float32
    # the kernels may round activations to 8 bits per block as llama.cpp does: ~1% of the output's scale
    assert (got.double() - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K])
def test_dequantize_and_matmul_follow_the_blocks(qtype):
    w = weight(qtype, 12, 512)
    dense = reference(w)
    assert torch.equal(w.dequantize(), dense)
    assert_matmul_close(w, dense)
    assert w.nbytes() == w.blocks.numel() < dense.numel() * 4 / 3


def test_rows_cols_and_permutation_are_exact():
    w = weight(T.Q4_K, 10, 512)
    dense = reference(w)
    assert torch.equal(w.rows(3, 4).dequantize(), dense[3:7])
    assert torch.equal(w.cols(256, 256).dequantize(), dense[:, 256:])
    order = torch.tensor([9, 0, 4, 1, 2, 3, 5, 6, 7, 8])
    assert torch.equal(w.permute_rows(order).dequantize(), dense[order])
    ids = torch.tensor([7, 7, 0, 3])
    assert torch.equal(w.lookup(ids, torch.bfloat16), dense[ids].to(torch.bfloat16))
    with pytest.raises(ValueError, match="256-column block boundaries"):
        w.cols(128, 256)
    with pytest.raises(ValueError, match="32-column block boundaries"):
        weight(T.Q8_0, 4, 64).cols(0, 48)
    with pytest.raises(ValueError, match="out of range"):
        w.rows(8, 4)


def test_concat_fuses_one_type_and_fuse_rows_stacks_mixed_types():
    q, k = weight(T.Q4_K, 8, 256, 1), weight(T.Q4_K, 4, 256, 2)
    fused = fuse_rows([q, k])
    assert isinstance(fused, GGUFWeight) and fused.out_features == 12
    assert torch.equal(fused.dequantize(), torch.cat([reference(q), reference(k)]))

    v = weight(T.Q6_K, 4, 256, 3)  # a Q4_K_M layer: Q4_K and Q6_K projections side by side
    assert GGUFWeight.concat_rows([q, v]) is None
    stacked = fuse_rows([q, k, v])
    assert isinstance(stacked, StackedRows) and stacked.shape == (16, 256)
    dense = torch.cat([reference(q), reference(k), reference(v)])
    assert torch.equal(stacked.dequantize(), dense)
    assert_matmul_close(stacked, dense)


# ---------------------------------------------------------------- the loader on a small GGUF file

HEADS, KV_HEADS, HIDDEN, VOCAB = 4, 2, 256, 40
# GGUF name -> (type, rows): Q and K in kernel types (their rows permuted by llama.cpp), V in IQ4_XS (no kernel)
TENSORS = {
    "token_embd.weight": (T.Q8_0, VOCAB),
    "blk.0.attn_q.weight": (T.Q4_K, HIDDEN),
    "blk.0.attn_k.weight": (T.Q6_K, HIDDEN // 2),
    "blk.0.attn_v.weight": (T.IQ4_XS, HIDDEN // 2),
    "blk.0.ffn_gate.weight": (T.F16, 64),
    "blk.0.attn_norm.weight": (T.F32, None),
}


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf")
    writer = gguf.GGUFWriter(str(path / "small.gguf"), "llama")
    writer.add_uint32("llama.attention.head_count", HEADS)
    writer.add_uint32("llama.attention.head_count_kv", KV_HEADS)
    rng = np.random.default_rng(0)
    for index, (name, (qtype, rows)) in enumerate(TENSORS.items()):
        if qtype == T.F32:
            writer.add_tensor(name, rng.standard_normal(HIDDEN).astype(np.float32))
        elif qtype == T.F16:
            writer.add_tensor(name, rng.standard_normal((rows, HIDDEN)).astype(np.float16))
        else:
            writer.add_tensor(name, random_blocks(qtype, rows, HIDDEN, index), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ModelConfig(path=str(path), gguf_file="small.gguf")


def test_loader_keeps_kernel_types_quantized_and_dequantizes_the_rest(small_gguf, caplog):
    from msgspec.structs import replace

    with caplog.at_level(logging.INFO, logger="tokenmill.model_loader"):
        kept = dict(iter_weights(replace(small_gguf, quantization="gguf")))
    notes = [r.getMessage() for r in caplog.records if "dequantizing" in r.getMessage()]
    assert notes == ["dequantizing GGUF tensors of type IQ4_XS to float32 at load: the CPU kernels have no such type"]
    dense = dict(iter_weights(replace(small_gguf, quantization="none")))
    assert kept.keys() == dense.keys()
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ]:
        assert isinstance(kept[name], GGUFWeight), name
        assert torch.equal(kept[name].dequantize(), dense[name]), name  # Q/K un-permuted by moving block rows
    assert kept["model.layers.0.self_attn.q_proj.weight"].type_name == "Q4_K"
    for name in [
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ]:
        assert isinstance(kept[name], torch.Tensor) and torch.equal(kept[name], dense[name]), name
    on_cuda = dict(iter_weights(replace(small_gguf, quantization="gguf"), device="cuda"))  # no GPU GGUF kernels
    assert all(isinstance(t, torch.Tensor) and torch.equal(t, dense[n]) for n, t in on_cuda.items())


# ---------------------------------------------------------------- layers taking quantized weights


def test_fused_layers_take_quantized_parts_and_drop_the_dense_parameter():
    q, k, v = weight(T.Q4_K, 256, 256, 1), weight(T.Q4_K, 128, 256, 2), weight(T.Q6_K, 128, 256, 3)
    qkv = QKVLinear(256, 64, 4, 2, bias=False, tp=TensorParallel())
    assert sum(qkv.load("weight", part, shard) for part, shard in zip((q, k, v), "qkv")) == 512 * 256
    assert isinstance(qkv.weight, StackedRows) and not list(qkv.parameters())
    x = torch.randn(3, 256)
    dense = torch.cat([reference(q), reference(k), reference(v)])
    expected = (x.double() @ dense.double().T).float()
    got = torch.cat([t.reshape(3, -1) for t in qkv(x)], dim=-1)
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()

    # rank 1 of 2: its KV head (rows 64..128 of k and v) and its two query heads
    rank1 = QKVLinear(256, 64, 4, 2, bias=False, tp=TensorParallel(1, 2))
    for part, shard in zip((q, k, v), "qkv"):
        rank1.load("weight", part, shard)
    rows = torch.cat([dense[128:256], dense[256 + 64 : 384], dense[384 + 64 :]])
    assert torch.equal(rank1.weight.dequantize(), rows)

    # parts some dense, some quantized: the quantized ones are dequantized into the dense parameter
    gate_up = GateUpLinear(256, 128, bias=False, tp=TensorParallel())
    gate = weight(T.Q8_0, 128, 256, 4)
    gate_up.load("weight", gate, "gate")
    gate_up.load("weight", torch.ones(128, 256), "up")
    assert isinstance(gate_up.weight, torch.nn.Parameter)
    assert torch.equal(gate_up.weight[:128], reference(gate)) and torch.equal(
        gate_up.weight[128:], torch.ones(128, 256)
    )


def test_row_parallel_splits_on_blocks_or_says_why_not():
    down = weight(T.Q4_K, 64, 512, 5)
    rank1 = RowParallelLinear(512, 64, bias=False, tp=TensorParallel(1, 2))
    assert rank1.load("weight", down) == 64 * 256
    assert torch.equal(rank1.weight.dequantize(), reference(down)[:, 256:])
    odd = RowParallelLinear(512, 64, bias=False, tp=TensorParallel(1, 4))  # columns 128..256: inside a Q4_K block
    with pytest.raises(ValueError, match=r"input columns \[128, 256\) of a gguf weight for tensor parallelism"):
        odd.load("weight", down)


def test_quantized_vocabulary_looks_up_rows_and_pads_the_heads_shard():
    table = weight(T.Q8_0, 7, 64, 6)
    dense = reference(table)
    embed = VocabEmbedding(7, 64)
    assert embed.load("weight", table) == 7 * 64 and not list(embed.parameters())
    ids = torch.tensor([6, 0, 6, 2])
    assert torch.equal(embed(ids), dense[ids])

    head = LMHead(7, 64, TensorParallel(1, 2), tied_to=VocabEmbedding(7, 64, TensorParallel(1, 2)))
    head._tied_to[0].load("weight", table)  # rank 1 of 2 holds rows 4..7 and one padding row
    head.follow_tied_embedding()
    assert head.weight is head._tied_to[0].weight and head.weight.out_features == 3
    assert torch.equal(head.weight.dequantize(), dense[4:])
    head.tp = TensorParallel()  # this rank's logits before the all-gather (no process group here)
    hidden = torch.randn(2, 64)
    logits = head(hidden)
    assert logits.shape == (2, 4) and torch.equal(logits[:, 3], torch.zeros(2))
    assert (logits[:, :3] - hidden @ dense[4:].T).abs().max() <= 0.02 * logits.abs().max()


# ---------------------------------------------------------------- the repacked layout (`pack_for_matmul`)


@pytest.fixture
def repack_everywhere(monkeypatch):
    """Repack whatever has the layout, whichever kernel version runs here (the portable one runs it too)."""
    from tokenmill.kernels import gguf_ops

    monkeypatch.setattr(
        gguf_ops, "repack_wanted", lambda qtype, out_features: qtype in gguf_ops.REPACK_TYPES and out_features >= 8
    )


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_a_repacked_weight_reads_and_multiplies_as_the_plain_one(qtype, repack_everywhere):
    w = weight(qtype, 21, 256)
    dense = reference(w)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2))
    before = w.matmul(x)
    plain = w.blocks
    w.pack_for_matmul()
    assert w.repacked and "repacked" in repr(w) and not torch.equal(w.blocks, plain)
    assert w.blocks.shape == plain.shape and w.nbytes() == plain.numel()  # reordered in place of the plain bytes
    packed = w.blocks
    w.pack_for_matmul()  # a tied embedding and LM head share the weight: the second call changes nothing
    assert w.blocks is packed
    assert torch.equal(w.plain_blocks(), plain)
    assert torch.equal(w.dequantize(), dense)
    torch.testing.assert_close(w.matmul(x), before, rtol=1e-5, atol=1e-5 * before.abs().max().item())
    ids = torch.tensor([[20, 3], [8, 0]])  # a plain tail row and rows of both groups
    assert torch.equal(w.lookup(ids, torch.float32), dense[ids])
    for part, rows in (
        (w.rows(5, 12), dense[5:17]),
        (w.permute_rows(torch.arange(20, -1, -1)), dense.flip(0)),
        (w.cols(32, 64), dense[:, 32:96]),
        (GGUFWeight.concat_rows([w, w]), torch.cat([dense, dense])),
    ):
        assert not part.repacked and torch.equal(part.dequantize(), rows)
    assert w.rows(0, 21) is w
    # inputs the checked-once int8 call hands to gguf_matmul: strided columns, bfloat16, and a batch of sequences
    wide = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(w.matmul(wide[:, ::2]), w.matmul(wide[:, ::2].contiguous()), rtol=0, atol=0)
    assert w.matmul(x.to(torch.bfloat16)).dtype == torch.bfloat16
    torch.testing.assert_close(w.matmul(x.view(3, 3, 256)), w.matmul(x).view(3, 3, 21), rtol=0, atol=0)


def test_pack_linear_weights_repacks_quantized_weights_once_and_the_tied_table_still_looks_up(repack_everywhere):
    from tokenmill.workers.models.layers import pack_linear_weights

    table = weight(T.Q8_0, 40, 64, 7)
    dense = reference(table)
    embed = VocabEmbedding(40, 64)
    head = LMHead(40, 64, tied_to=embed)
    embed.load("weight", table)
    head.follow_tied_embedding()
    qkv = QKVLinear(256, 64, 4, 2, bias=False, tp=TensorParallel())  # Q4_1 q and v around a Q6_K k: stacked
    q, k, v = weight(T.Q4_1, 256, 256, 8), weight(T.Q6_K, 128, 256, 9), weight(T.Q4_1, 128, 256, 10)
    for part, shard in zip((q, k, v), "qkv"):
        qkv.load("weight", part, shard)
    qkv_dense = torch.cat([reference(q), reference(k), reference(v)])
    pack_linear_weights(torch.nn.ModuleList([embed, head, qkv]))
    assert head.weight is embed.weight and embed.weight.repacked and head.packed_tied_weight is None
    ids = torch.tensor([39, 0, 17])
    assert torch.equal(embed(ids), dense[ids])
    hidden = torch.randn(2, 64)
    expected = hidden @ dense.T
    assert (head(hidden) - expected).abs().max() <= 0.02 * expected.abs().max()
    assert [part.repacked for part in qkv.weight.parts] == [True, False, True]  # Q6_K has no repacked layout
    x = torch.randn(3, 256)
    expected = x @ qkv_dense.T
    got = torch.cat([t.reshape(3, -1) for t in qkv(x)], dim=-1)
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_stacked_parts_write_their_columns_of_one_output():
    """StackedRows runs each part's kernel into its column slice (no torch.cat, which a recorded CPU decode step
    could not replay): the same bits as each part's own matmul, side by side."""
    parts = [weight(T.Q5_0, 24, 256, 1), weight(T.Q5_0, 8, 256, 2), weight(T.Q8_0, 8, 256, 3)]
    for part in parts:
        part.pack_for_matmul()
    stacked = StackedRows(parts)
    for tokens in (1, 3):
        x = torch.randn(tokens, 256)
        assert torch.equal(stacked.matmul(x), torch.cat([part.matmul(x) for part in parts], dim=-1))
    wide = torch.full((2, 50), 7.0)
    x = torch.randn(2, 256)
    parts[1].matmul_into(x, wide[:, 20:28])
    assert torch.equal(wide[:, 20:28], parts[1].matmul(x))
    assert bool((wide[:, :20] == 7).all()) and bool((wide[:, 28:] == 7).all())
