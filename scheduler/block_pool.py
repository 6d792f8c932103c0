"""The pool of physical KV-cache blocks: reference counts, an O(1) LRU free queue and the prefix-cache index.

A block is free when no request references it. Free blocks wait in the free queue in least-recently-freed order;
a free block may still hold a hash (its KV content is intact), so a later request with the same prefix can reclaim it
("touch") instead of recomputing. Fresh allocations take blocks from the head of the queue and evict their hash.

The index is keyed by a sha256 chain that starts from a random root per pool, so no tenant can predict or construct
another's keys; and every indexed block keeps what its KV holds (`BlockContent`), compared on each hit, so even
colliding keys cannot make one prefix read another's KV (vLLM CVE-2025-25183).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

ROOT_CONTENT_ID = 0  # the "parent" of a request's first block; indexed contents are numbered from 1
# what `BlockPool.state` says of a block (the dashboard's block map starts from it)
BLOCK_FREE, BLOCK_CACHED, BLOCK_IN_USE = 0, 1, 2

_encode = msgspec.msgpack.Encoder().encode


# what a request's first block folds in besides its tokens: its cache salt, or (salt, LoRA adapter id) for a request
# of an adapter (a tuple, so no salt alone can spell an adapter's key)
ExtraKey = str | tuple[str | None, int] | None


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_key: ExtraKey) -> bytes:
    """The prefix-cache key of one full block: sha256 chaining the parent's key, the block's tokens and extra keys."""
    return hashlib.sha256(parent_hash + _encode((token_ids, extra_key))).digest()


# What an indexed block's KV was computed from: (the parent block's content id, its token ids, extra key). A plain
# tuple: it is built and compared for every block of every prefix lookup.
BlockContent = tuple[int, tuple[int, ...], ExtraKey]


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is indexed in the prefix cache
    content: BlockContent | None = None  # set while indexed
    # unique per indexing, never reused: a child names its parent by it, so a parent evicted and re-indexed with
    # other content can never pass for the old one
    content_id: int = ROOT_CONTENT_ID


class BlockPool:
    """Owns every block: hands out fresh ones, takes them back, and indexes full blocks by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # block_id -> Block in least-recently-freed-first order; popitem(last=False) is the eviction candidate
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}  # hash -> the block holding that content
        self.root_hash = os.urandom(32)  # the parent key of every request's first block, secret to this pool
        self._content_ids = itertools.count(ROOT_CONTENT_ID + 1)
        # one byte per block, kept as blocks move: BLOCK_FREE, BLOCK_CACHED (free, content still indexed) or
        # BLOCK_IN_USE; a copy is the dashboard's block map, at no cost per summary beyond the copy
        self.state = bytearray(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached ones included: they can be evicted)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def allocate(self, count: int) -> list[Block]:
        """Take `count` blocks from the head of the free queue, evicting whatever they cached."""
        if count > len(self.free_queue):
            raise ValueError(f"asked for {count} blocks, only {len(self.free_queue)} free")
        taken = []
        state = self.state
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            state[block.block_id] = BLOCK_IN_USE
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (prefix-cache hits), pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
                self.state[block.block_id] = BLOCK_IN_USE
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a reference from each block; a block nobody holds goes to the tail of the free queue, hash kept.

        Callers pass a request's blocks tail first, so its prefix blocks (the likeliest to be shared) are evicted last.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
                self.state[block.block_id] = BLOCK_FREE if block.hash is None else BLOCK_CACHED

    def get_cached(self, block_hash: bytes, content: BlockContent) -> Block | None:
        """The indexed block holding exactly `content`, or None (a key held by other content is a miss)."""
        if not self.enable_caching:
            return None
        block = self.cached.get(block_hash)
        return block if block is not None and block.content == content else None

    def cache(self, block: Block, block_hash: bytes, content: BlockContent) -> Block | None:
        """Index a full, computed block. Returns the block now indexed for `content`: this one, or an earlier block
        with the same content (kept); None when another content holds the key (nothing is indexed)."""
        if not self.enable_caching:
            return None
        if block.hash is not None:
            return block if block.content == content else None
        holder = self.cached.get(block_hash)
        if holder is not None:
            return holder if holder.content == content else None
        block.hash = block_hash
        block.content = content
        block.content_id = next(self._content_ids)
        self.cached[block_hash] = block
        return block

    def _evict(self, block: Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
            block.hash = None
            block.content = None
