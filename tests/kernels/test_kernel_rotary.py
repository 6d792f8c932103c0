"""Rotary embedding kernel against its reference and against HF Llama's apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tokenmill.kernels import rotary
from tokenmill.kernels.rotary import apply_rotary, apply_rotary_ref, rotary_cos_sin_cache

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
MAX_POSITION = 300


def random_qk(num_tokens: int, group: int, head_dim: int, dtype=torch.float32):
    num_kv_heads = 2
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,))
    return q, k, positions


@pytest.mark.parametrize("neox_style", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_rotary_matches_reference(group, head_dim, neox_style):
    q, k, positions = random_qk(11, group, head_dim)
    cos_sin = rotary_cos_sin_cache(head_dim, MAX_POSITION, 1e5)
    out_q, out_k = apply_rotary(q, k, positions, cos_sin, neox_style)
    ref_q, ref_k = apply_rotary_ref(q, k, positions, cos_sin, neox_style)
    torch.testing.assert_close(out_q, ref_q, **TOLERANCES[torch.float32])
    torch.testing.assert_close(out_k, ref_k, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_half_precision(dtype):
    q, k, positions = random_qk(9, 3, 64, dtype)
    cos_sin = rotary_cos_sin_cache(64, MAX_POSITION)
    out_q, out_k = apply_rotary(q, k, positions, cos_sin)
    ref_q, ref_k = apply_rotary_ref(q, k, positions, cos_sin)
    assert out_q.dtype == dtype and out_k.dtype == dtype
    torch.testing.assert_close(out_q, ref_q, **TOLERANCES[dtype])
    torch.testing.assert_close(out_k, ref_k, **TOLERANCES[dtype])


def test_neox_style_is_hf_llama_rotate_half():
    head_dim = 64
    q, k, positions = random_qk(13, 3, head_dim)
    cos_sin = rotary_cos_sin_cache(head_dim, MAX_POSITION, 1e5)
    out_q, out_k = apply_rotary(q, k, positions, cos_sin)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1)[None], torch.cat([sin, sin], dim=-1)[None]  # HF: [1, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(out_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_position_zero_is_identity_and_norms_are_kept():
    q, k, _ = random_qk(4, 3, 64)
    cos_sin = rotary_cos_sin_cache(64, MAX_POSITION)
    out_q, out_k = apply_rotary(q, k, torch.zeros(4, dtype=torch.long), cos_sin)
    torch.testing.assert_close(out_q, q)
    torch.testing.assert_close(out_k, k)
    out_q, _ = apply_rotary(q, k, torch.full((4,), 123), cos_sin)
    assert not torch.allclose(out_q, q)
    torch.testing.assert_close(out_q.norm(dim=-1), q.norm(dim=-1))


def test_partial_rotary_passes_the_tail_through():
    q, k, positions = random_qk(6, 3, 64)
    cos_sin = rotary_cos_sin_cache(32, MAX_POSITION)  # rotate only the first 32 dims
    out_q, out_k = apply_rotary(q, k, positions, cos_sin)
    ref_q, ref_k = apply_rotary_ref(q, k, positions, cos_sin)
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)
    assert torch.equal(out_q[..., 32:], q[..., 32:])


def test_inplace_on_views_of_fused_qkv():
    num_tokens, head_dim, num_q_heads, num_kv_heads = 5, 64, 6, 2
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)
    original = qkv.clone()
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    positions = torch.tensor([0, 7, 7, 250, 3])
    cos_sin = rotary_cos_sin_cache(head_dim, MAX_POSITION)
    ref_q, ref_k = apply_rotary_ref(q.clone(), k.clone(), positions, cos_sin)
    out_q, out_k = apply_rotary(q, k, positions, cos_sin, inplace=True)
    assert out_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(q, ref_q)
    torch.testing.assert_close(k, ref_k)
    value_columns = slice((num_q_heads + num_kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, value_columns], original[:, value_columns])  # V untouched


def test_empty_and_single_token(monkeypatch):
    cos_sin = rotary_cos_sin_cache(64, MAX_POSITION)
    q, k, positions = random_qk(1, 3, 64)
    out_q, out_k = apply_rotary(q, k, positions, cos_sin)
    ref_q, ref_k = apply_rotary_ref(q, k, positions, cos_sin)
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("an empty batch must not launch a kernel")

    monkeypatch.setattr(rotary, "_rotary_kernel", NoLaunch())
    q, k, positions = random_qk(0, 3, 64)
    out_q, out_k = apply_rotary(q, k, positions, cos_sin)
    assert out_q.shape == (0, 6, 64) and out_k.shape == (0, 2, 64)
