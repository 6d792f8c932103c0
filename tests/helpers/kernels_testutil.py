"""Test helper: random sequences laid out in a paged KV cache through shuffled block tables."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.kernels.kv_write import write_kv_ref


@dataclass
class PagedCache:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence, [seq_len, Hkv, D] in the cache dtype
    values: list[torch.Tensor]


def slots_for(block_table: torch.Tensor, positions: range, block_size: int) -> list[int]:
    return [int(block_table[pos // block_size]) * block_size + pos % block_size for pos in positions]


def make_paged_cache(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> PagedCache:
    """Fill a cache with random K/V for each sequence; physical blocks are a random permutation.

    Every slot no sequence owns (the tail of each last block, spare blocks) holds NaN, as an
    uninitialized cache may, so a kernel that lets an unowned slot into its math shows up.
    """
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    physical = torch.randperm(num_blocks).to(torch.int32)
    max_blocks = max(blocks_per_seq, default=0) + 1  # a spare column: tables are wider than needed
    unused_block = int(physical[-1])  # never handed to a sequence, so it stays NaN
    block_tables = torch.full((len(seq_lens), max_blocks), unused_block, dtype=torch.int32)
    keys, values, next_block = [], [], 0
    for seq, seq_len in enumerate(seq_lens):
        count = blocks_per_seq[seq]
        block_tables[seq, :count] = physical[next_block : next_block + count]
        next_block += count
        key = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        value = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        slots = torch.tensor(slots_for(block_tables[seq], range(seq_len), block_size), dtype=torch.int64)
        write_kv_ref(key, value, k_cache, v_cache, slots)
        keys.append(key)
        values.append(value)
    return PagedCache(k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), keys, values)


def poison_blocks_before_windows(cache, first_keys: list[int], block_size: int) -> None:
    """Point each sequence's table entries for blocks wholly before its first visible key at a block of NaN."""
    nan_block = cache.k_cache.shape[0] - 1
    while (cache.block_tables == nan_block).any():  # a block no sequence uses
        nan_block -= 1
    # make_paged_cache leaves unused blocks NaN; make sure of it
    cache.k_cache[nan_block] = float("nan")
    cache.v_cache[nan_block] = float("nan")
    for seq, first_key in enumerate(first_keys):
        cache.block_tables[seq, : first_key // block_size] = nan_block
