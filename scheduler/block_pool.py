"""The pool of physical KV-cache blocks: reference counts, an O(1) LRU free queue and the prefix-cache index.

A block is free when no request references it. Free blocks wait in the free queue in least-recently-freed order;
a free block may still hold a hash (its KV content is intact), so a later request with the same prefix can reclaim it
("touch") instead of recomputing. Fresh allocations take blocks from the head of the queue and evict their hash.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

# The parent hash of a request's first block. Any fixed int works; a constant keeps hashes reproducible.
ROOT_BLOCK_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_key: str | None) -> int:
    """The prefix-cache hash of one full block: it chains the parent's hash, the block's tokens and extra keys.

    Python's hash of ints, strings and tuples is deterministic within a process, which is all we need: only the
    scheduler process ever compares these hashes.
    """
    return hash((parent_hash, tuple(token_ids), extra_key))


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is indexed in the prefix cache


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
        self.cached: dict[int, Block] = {}  # hash -> the block holding that content

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
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (prefix-cache hits), pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
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

    def get_cached(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache(self, block: Block, block_hash: int) -> None:
        """Index a full, computed block under its hash. If another block already holds that content, keep that one."""
        if not self.enable_caching or block.hash is not None or block_hash in self.cached:
            return
        block.hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
            block.hash = None
