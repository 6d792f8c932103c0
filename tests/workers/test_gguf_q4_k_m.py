"""A Q4_K_M file of a 0.5B-class model loads with every matrix kept quantized and runs as its dequantized twin.

Qwen2.5-0.5B's rows are 896 wide, not a multiple of the k-quants' 256, so llama.cpp's Q4_K_M writes its 896-wide
matrices in the fallback types (Q4_K -> Q5_0, Q6_K -> Q8_0) and only the 4864-wide `ffn_down` in Q4_K / Q6_K. This
file has that mix on the real config's widths (hidden 896, MLP 4864, 14 query and 2 KV heads of 64), two layers and a
small vocabulary to stay fast. Q5_0 and Q8_0 blocks come from the `gguf` package's quantizers; it cannot quantize the
k-quants, so `ffn_down`'s blocks come from the small reference quantizers below (valid blocks of the real layouts).
A Q2_K / Q3_K variant (the low-bit files' `ffn_down` types) takes valid random blocks of those types instead.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from msgspec.structs import replace

from tests.helpers.gguf_kernels import random_blocks
from tests.helpers.runner_driver import logits_in_chunks
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.kernels import gguf_ops
from tokenmill.workers.attention import build_attention_metadata
from tokenmill.workers.cpu_graphs import CpuDecodeGraphs
from tokenmill.workers.cpu_verify_graphs import CpuSpeculativeGraphs
from tokenmill.workers.model_loader import iter_weights
from tokenmill.workers.quantization.base import QuantizedWeight, StackedRows
from tokenmill.workers.quantization.gguf import GGUFWeight
from tokenmill.workers.worker import Worker

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 896, 4864, 14, 2, 64, 2, 512
QK_K = 256


def _half_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks of `w` [rows, cols]: per 32 values a 6-bit scale and min of the block's d and dmin (min-max
    quantization, no search: llama.cpp's layout, not its rounding choices)."""
    rows, cols = w.shape
    sub = w.reshape(rows, cols // QK_K, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(axis=-1), 0.0)
    step = (sub.max(axis=-1) - low) / 15  # [rows, nb, 8]
    d = np.maximum(step.max(axis=-1), 1e-8) / 63
    dmin = np.maximum((-low).max(axis=-1), 1e-8) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    scales = np.clip(np.rint(step / d[..., None]), 1, 63).astype(np.uint8)
    mins = np.clip(np.rint(-low / dmin[..., None]), 0, 63).astype(np.uint8)
    q = np.rint((sub + (dmin[..., None] * mins)[..., None]) / (d[..., None] * scales)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)  # [rows, nb, 8, 32]
    packed = np.empty((rows, cols // QK_K, 12), dtype=np.uint8)  # ggml's get_scale_min_k4 layout
    packed[..., 0:4] = scales[..., 0:4] | ((scales[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = mins[..., 0:4] | ((mins[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (scales[..., 4:8] & 15) | ((mins[..., 4:8] & 15) << 4)
    qs = q[..., 0::2, :] | (q[..., 1::2, :] << 4)  # sub-blocks 2c, 2c + 1: low, high nibbles of 32 bytes
    blocks = np.concatenate(
        [
            _half_bytes(d)[..., None].reshape(rows, -1, 2),
            _half_bytes(dmin).reshape(rows, -1, 2),
            packed,
            qs.reshape(rows, -1, 128),
        ],
        axis=-1,
    )
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of `w`: per 16 values an int8 scale of the block's d, q = round(w / (d * scale)) + 32."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // QK_K, 16, 16).astype(np.float32)
    group_scale = np.abs(groups).max(axis=-1) / 31
    d = (np.maximum(group_scale.max(axis=-1), 1e-8) / 127).astype(np.float16).astype(np.float32)
    scales = np.clip(np.rint(group_scale / d[..., None]), 1, 127).astype(np.int8)
    q = np.rint(groups / (d[..., None] * scales)[..., None]) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # element 128 h + 32 i + l
    ql = np.concatenate(
        [(q[:, :, h, 0] & 15) | ((q[:, :, h, 2] & 15) << 4) for h in range(2)]
        + [(q[:, :, h, 1] & 15) | ((q[:, :, h, 3] & 15) << 4) for h in range(2)],
        axis=-1,
    )
    ql = ql.reshape(rows, -1, 2, 2, 32).transpose(0, 1, 3, 2, 4).reshape(rows, -1, 128)  # ql[64 h + l], l < 64
    qh = sum((q[:, :, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8).reshape(rows, -1, 64)
    blocks = np.concatenate([ql, qh, scales.view(np.uint8), _half_bytes(d).reshape(rows, -1, 2)], axis=-1)
    return blocks.reshape(rows, -1)


Q4_K_M_DOWN = (T.Q6_K, T.Q4_K)


# GGUF tensor -> (type, rows, cols) as llama.cpp's Q4_K_M writes a Qwen2.5-0.5B layer (ffn_down alternating types)
def layer_tensors(layer: int, down: tuple[T, T] = Q4_K_M_DOWN) -> dict[str, tuple[T, int, int]]:
    return {
        f"blk.{layer}.attn_q.weight": (T.Q5_0, HEADS * HEAD_DIM, HIDDEN),
        f"blk.{layer}.attn_k.weight": (T.Q5_0, KV_HEADS * HEAD_DIM, HIDDEN),
        f"blk.{layer}.attn_v.weight": (T.Q8_0, KV_HEADS * HEAD_DIM, HIDDEN),
        f"blk.{layer}.attn_output.weight": (T.Q5_0, HIDDEN, HEADS * HEAD_DIM),
        f"blk.{layer}.ffn_gate.weight": (T.Q5_0, FFN, HIDDEN),
        f"blk.{layer}.ffn_up.weight": (T.Q5_0, FFN, HIDDEN),
        f"blk.{layer}.ffn_down.weight": (down[layer % 2], HIDDEN, FFN),
    }


def quantized(qtype: T, w: np.ndarray) -> np.ndarray:
    if qtype == T.Q4_K:
        return quantize_q4_k(w)
    if qtype == T.Q6_K:
        return quantize_q6_k(w)
    if qtype in (T.Q2_K, T.Q3_K):  # no quantizer at hand: valid random blocks (weights of a similar size)
        return random_blocks(qtype, *w.shape, np.random.default_rng(w.shape))
    return gguf.quants.quantize(w, qtype)


def write_q4_k_m_file(path, down: tuple[T, T] = Q4_K_M_DOWN) -> None:
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (T.Q8_0, VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        tensors |= layer_tensors(layer, down)
    for name, (qtype, rows, cols) in tensors.items():
        w = rng.standard_normal((rows, cols)).astype(np.float32) * (0.5 if name == "token_embd.weight" else 0.04)
        writer.add_tensor(name, quantized(qtype, w), raw_dtype=qtype)
    for layer in range(LAYERS):
        for projection, rows in (("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM)):
            writer.add_tensor(f"blk.{layer}.attn_{projection}.bias", rng.standard_normal(rows).astype(np.float32) * 0.1)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def q4_k_m_model(tmp_path_factory) -> ModelConfig:
    folder = tmp_path_factory.mktemp("q4_k_m")
    write_q4_k_m_file(folder / "qwen2.5-0.5b-like.Q4_K_M.gguf")
    return ModelConfig(path=str(folder), gguf_file="qwen2.5-0.5b-like.Q4_K_M.gguf", dtype="float32")


def test_the_reference_quantizers_write_what_gguf_reads():
    w = np.random.default_rng(1).standard_normal((3, 2 * QK_K)).astype(np.float32) * 0.05
    for qtype, quantize, tolerance in ((T.Q4_K, quantize_q4_k, 0.15), (T.Q6_K, quantize_q6_k, 0.04)):
        blocks = quantize(w)
        assert blocks.shape == (3, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
        back = gguf.quants.dequantize(blocks, qtype).reshape(w.shape)
        assert np.abs(back - w).max() <= tolerance * np.abs(w).max(), qtype.name


def test_every_matrix_stays_quantized_and_nothing_is_dequantized_at_load(q4_k_m_model, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.model_loader"):
        weights = dict(iter_weights(replace(q4_k_m_model, quantization="gguf")))
    assert not [r.getMessage() for r in caplog.records if "dequantizing" in r.getMessage()]
    matrices = {name: w for name, w in weights.items() if name.endswith("proj.weight") or "embed" in name}
    assert len(matrices) == 1 + 7 * LAYERS
    assert all(isinstance(w, GGUFWeight) for w in matrices.values())
    assert {w.type_name for w in matrices.values()} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}


def make_runner(model: ModelConfig, quantization: str) -> Worker:
    config = EngineConfig(
        model=replace(model, quantization=quantization),
        cache=CacheConfig(block_size=16, num_kv_blocks=16),
        parallel=ParallelConfig(device="cpu"),
    )
    runner = Worker(config)
    runner.load_model()
    return runner


def test_the_quantized_model_runs_as_its_dequantized_twin(q4_k_m_model):
    kept, dense = make_runner(q4_k_m_model, "gguf"), make_runner(q4_k_m_model, "none")
    assert_runs_as_dense_twin(kept, dense)


def test_q2_k_and_q3_k_run_repacked_as_their_dequantized_twin(tmp_path):
    write_q4_k_m_file(tmp_path / "low-bit.gguf", down=(T.Q2_K, T.Q3_K))
    model = ModelConfig(path=str(tmp_path), gguf_file="low-bit.gguf", dtype="float32")
    kept, dense = make_runner(model, "gguf"), make_runner(model, "none")
    for layer, qtype in zip(kept.model.model.layers, (T.Q2_K, T.Q3_K), strict=True):
        down = layer.mlp.down_proj.weight
        assert isinstance(down, GGUFWeight) and down.type_name == qtype.name
        assert down.repacked == gguf_ops.repack_wanted(int(qtype), HIDDEN)
    assert_runs_as_dense_twin(kept, dense)


def assert_runs_as_dense_twin(kept: Worker, dense: Worker) -> None:
    layer = kept.model.model.layers[0]
    gate_up = layer.mlp.gate_up_proj.weight  # gate and up both Q5_0: one weight, in the repacked layout where Q4_0
    assert isinstance(gate_up, GGUFWeight) and gate_up.repacked == gguf_ops.repack_wanted(int(T.Q5_0), 2 * FFN)
    assert isinstance(layer.self_attn.qkv_proj.weight, QuantizedWeight)
    assert kept.weight_bytes < 0.3 * dense.weight_bytes  # ~5.5 bits against 32 per weight
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, VOCAB, 24))
    bounds = [0, 20, 21, 22, 23, 24]  # a prefill chunk, then one-token decode steps
    reference = logits_in_chunks(dense.model, ids, bounds).log_softmax(-1)
    got = logits_in_chunks(kept.model, ids, bounds).log_softmax(-1)
    kl = (reference.exp() * (reference - got)).sum(-1)
    assert kl.mean() < 0.02, kl.mean().item()  # the int8 activation rounding only (test_quantized_gguf's bound)
    assert not torch.equal(reference, got)  # the kernels ran


def test_decode_steps_are_recorded_and_replay_the_eager_forward(q4_k_m_model, use_cpu_backend):
    """Qwen2's q/k/v bias and a QKV stacked from two types (Q5_0 q/k, Q8_0 v) are compiled-kernel calls alone, so
    the decode steps are recorded (they stayed eager: the bias add and the stacking's torch.cat) and replay the eager
    forward bit for bit."""
    use_cpu_backend("kernels")
    runner = make_runner(q4_k_m_model, "gguf")
    assert isinstance(runner.model.model.layers[0].self_attn.qkv_proj.weight, StackedRows)
    runner.allocate_kv_cache(16)
    runner.capture_cuda_graphs()
    assert isinstance(runner.decode_graphs, CpuSpeculativeGraphs)
    with torch.inference_mode():
        graphs = CpuDecodeGraphs(runner.model, runner.kv_caches, [1, 2], 4, 16, HIDDEN, runner.dtype)
        rng = np.random.default_rng(5)
        for num_seqs in (1, 2):
            seq_lens = rng.integers(5, 60, num_seqs)
            tables = rng.permutation(np.arange(1, 16))[: num_seqs * 4].reshape(num_seqs, 4)
            attn = build_attention_metadata(
                np.ones(num_seqs, dtype=np.int64), seq_lens, tables, 16, runner.device, graphs.attention
            )
            ids, positions = torch.as_tensor(rng.integers(0, VOCAB, num_seqs)), torch.as_tensor(seq_lens - 1)
            caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            expected = runner.model(ids, positions, attn, runner.kv_caches)
            for (k, v), (k0, v0) in zip(runner.kv_caches, caches, strict=True):
                k.copy_(k0)
                v.copy_(v0)
            assert torch.equal(graphs.run(ids, positions, attn), expected), f"batch of {num_seqs}"
