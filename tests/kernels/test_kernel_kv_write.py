"""KV-cache write kernel against its torch reference and against the slot arithmetic itself."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import kv_write
from tokenmill.kernels.kv_write import write_kv, write_kv_ref


def make_slots(num_tokens: int, num_blocks: int, block_size: int) -> torch.Tensor:
    """Distinct random slots, with every fourth token marked as padding (-1)."""
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::4] = -1
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_matches_reference(block_size, head_dim, dtype):
    num_blocks, num_kv_heads, num_tokens = 5, 3, 37
    key = torch.randn(num_tokens, num_kv_heads, head_dim)  # fp32 input: the kernel casts on store
    value = torch.randn(num_tokens, num_kv_heads, head_dim)
    slots = make_slots(num_tokens, num_blocks, block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, -7.0, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slots)
    write_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fp8_quantizes_with_scales(dtype, cache_dtype):
    """fp8 caches store value / scale, rounded to nearest even (bit-exact with torch's conversion); e4m3fn clamps to
    its largest finite first, whatever the conversion does past it."""
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 4, 16, 2, 64, 29
    key = (torch.randn(num_tokens, num_kv_heads, head_dim) * 100).to(dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_dim) * 1e-3).to(dtype)
    key[1, 0, :4] = torch.tensor([1e5, -1e5, 465.0, 2.0**-12])  # past the largest e4m3, a tie, a subnormal
    slots = make_slots(num_tokens, num_blocks, block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slots, k_scale=0.5, v_scale=1e-3)
    write_kv_ref(key, value, k_ref, v_ref, slots, k_scale=0.5, v_scale=1e-3)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    keep = slots >= 0
    stored = k_ref.view(-1, num_kv_heads, head_dim)[slots[keep]]
    scaled = key[keep].float() / 0.5
    if cache_dtype == torch.float8_e4m3fn:  # saturates at its largest finite; e5m2 overflows to infinity
        scaled = scaled.clamp(-448.0, 448.0)
    assert torch.equal(stored.view(torch.uint8), scaled.to(cache_dtype).view(torch.uint8))
    if cache_dtype == torch.float8_e4m3fn:  # 1e5 / 0.5 and -1e5 / 0.5, and 465 / 0.5 = 930: the largest finite
        assert slots[1] >= 0  # token 1 is written (make_slots pads every fourth from token 0)
        special = k_cache.view(-1, num_kv_heads, head_dim)[slots[1], 0, :3]
        assert special.float().tolist() == [448.0, -448.0, 448.0]


def test_slot_arithmetic_and_padding():
    block_size, num_kv_heads, head_dim = 16, 2, 64
    k_cache = torch.zeros(4, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, num_kv_heads, head_dim)
    value = torch.randn(3, num_kv_heads, head_dim)
    write_kv(key, value, k_cache, v_cache, torch.tensor([2 * block_size + 5, -1, 17]))
    assert torch.equal(k_cache[2, 5], key[0]) and torch.equal(v_cache[2, 5], value[0])
    assert torch.equal(k_cache[1, 1], key[2]) and torch.equal(v_cache[1, 1], value[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2  # the padding token wrote nothing


def test_strided_key_value_from_fused_qkv():
    num_kv_heads, head_dim, block_size = 2, 64, 16
    qkv = torch.randn(9, (4 + 2 * num_kv_heads) * head_dim)
    key = qkv[:, 4 * head_dim : 6 * head_dim].view(9, num_kv_heads, head_dim)
    value = qkv[:, 6 * head_dim :].view(9, num_kv_heads, head_dim)
    slots = torch.arange(9) + 3
    k_cache = torch.zeros(2, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[3:12], key)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[3:12], value)


def test_empty_write_does_not_launch(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("an empty write must not launch a kernel")

    monkeypatch.setattr(kv_write, "_write_kv_kernel", NoLaunch())
    cache = torch.zeros(2, 16, 2, 64)
    write_kv(torch.empty(0, 2, 64), torch.empty(0, 2, 64), cache, cache.clone(), torch.empty(0, dtype=torch.int64))
    assert torch.all(cache == 0)
