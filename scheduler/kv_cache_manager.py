"""Maps requests to KV-cache blocks: prefix-cache lookup, slot allocation for the next tokens, caching, freeing.

A request's block table is a list of physical blocks covering its tokens in order. Full blocks get a hash that
chains the parent block's hash with the block's token ids; the request's cache salt and LoRA adapter id are folded
in once, into the first block's key and content (vLLM's rule: every later block carries them through its parent), so
the work per block never grows with the salt. Once their KV is computed they are indexed in the pool so a later
request with the same prefix reuses them instead of recomputing. A hit must also match the block's recorded content
(tokens, the salt and adapter for the first block, and the very parent block matched before it), so the hash only
finds candidates and never decides what KV a request reads.

Sliding window (a model whose every layer attends to at most `window` keys): `free_leading_blocks` returns the blocks
at the front of a running request's table that no later query can see. They leave `req_blocks` (which holds the live
tail); `num_freed_blocks` counts them, so table positions stay absolute. A freed block keeps its prefix-cache entry
until evicted: its KV is still exactly that prefix's, so a later request may hit it (hits always run from the first
block, through intact content).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.scheduler.block_pool import ROOT_CONTENT_ID, Block, BlockContent, BlockPool, ExtraKey, hash_block
from tokenmill.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def root_extra_key(request: Request) -> ExtraKey:
    """What the request's first block key and content fold in besides tokens: its cache salt, and its LoRA adapter's
    id, so a request never reads KV computed by the base or by another adapter (or by an earlier load of its own
    adapter's name: a reload gets a new id)."""
    if request.lora_request is None:
        return request.cache_salt
    return request.cache_salt, request.lora_request.lora_int_id


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[Block]] = {}  # each request's live blocks (after its freed leading ones)
        self.num_freed_blocks: dict[str, int] = {}  # leading blocks of a request freed as they left the window
        self.num_indexed_blocks: dict[str, int] = {}  # leading blocks of each request already in the prefix cache
        # content id of the indexed block holding each request's prefix up to there; None once a colliding key
        # stopped its indexing (its later blocks then stay private)
        self.last_indexed_id: dict[str, int | None] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached full blocks that starts the request's tokens, leaving its last token to compute
        (the step needs logits to sample from). Counts nothing and takes no references: call allocate_slots next.

        A request that asks for prompt logprobs reads nothing from the cache (as vLLM V1): a cached prefix has no
        hidden states to score its tokens with, so its whole prompt is computed. Its blocks are still cached for
        others once computed."""
        if not self.enable_prefix_caching or request.is_embedding or request.sampling.prompt_logprobs is not None:
            return []
        self._extend_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        parent_id = ROOT_CONTENT_ID
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.pool.get_cached(block_hash, self._content(request, i, parent_id))
            if block is None:
                break
            hits.append(block)
            parent_id = block.content_id
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[Block] = (), num_lookahead_tokens: int = 0
    ) -> list[int] | None:
        """Give the request blocks for `num_new_tokens` more tokens after its computed ones (and after
        `cached_blocks`, prefix hits of a request being scheduled from scratch), plus `num_lookahead_tokens` slots
        past them that the step writes without computing them (the draft model's KV, as vLLM's
        num_lookahead_tokens). Returns the ids of the blocks added to its table, or None, changing nothing, when the
        pool is short."""
        known = self.req_blocks.get(request.request_id)
        blocks = known if known is not None else []
        num_tokens_after = (
            request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens + num_lookahead_tokens
        )
        num_table_blocks = len(blocks) + self.num_freed_blocks.get(request.request_id, 0)
        num_fresh = self.num_blocks_for(num_tokens_after) - num_table_blocks - len(cached_blocks)
        if known is not None and num_fresh <= 0 and not cached_blocks:
            return []  # a running request's usual step: nothing to take, touch or index
        # hits that sit in the free queue stop being allocatable once we take them
        num_free_hits = sum(1 for b in cached_blocks if b.ref_count == 0)
        if max(num_fresh, 0) + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(cached_blocks)  # before allocating, so the fresh blocks cannot evict the hits
        added = list(cached_blocks) + (self.pool.allocate(num_fresh) if num_fresh > 0 else [])
        if request.request_id not in self.req_blocks:
            self.req_blocks[request.request_id] = blocks
            self.num_indexed_blocks[request.request_id] = len(cached_blocks)
            self.last_indexed_id[request.request_id] = (
                cached_blocks[-1].content_id if cached_blocks else ROOT_CONTENT_ID
            )
        blocks.extend(added)
        return [b.block_id for b in added]

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's full blocks whose KV the workers have computed, so later requests can share them.

        Under overlap scheduling that may include blocks the step in flight is writing: only later plans can read a
        hit, and the workers run plans in order."""
        request_id = request.request_id
        start = self.num_indexed_blocks.get(request_id)  # None: no blocks (or prefix caching off, then never set)
        if not self.enable_prefix_caching or start is None:
            return
        # overlap scheduling counts a token still being sampled as computed: only blocks of known tokens are indexed
        num_full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        parent_id = self.last_indexed_id[request_id]
        if num_full <= start or parent_id is None:
            return
        self._extend_block_hashes(request)
        blocks = self.req_blocks[request_id]
        num_freed = self.num_freed_blocks.get(request_id, 0)
        if start < num_freed:  # blocks freed before they were indexed: the chain cannot go on past them
            self.last_indexed_id[request_id] = None
            return
        for i in range(start, num_full):
            holder = self.pool.cache(
                blocks[i - num_freed], request.block_hashes[i], self._content(request, i, parent_id)
            )
            parent_id = holder.content_id if holder is not None else None
            if parent_id is None:
                break
        self.num_indexed_blocks[request_id] = num_full
        self.last_indexed_id[request_id] = parent_id

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool, tail first; cached content stays reusable until evicted."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_freed_blocks.pop(request.request_id, None)
        self.num_indexed_blocks.pop(request.request_id, None)
        self.last_indexed_id.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def free_leading_blocks(self, request: Request, num_blocks: int) -> int:
        """Free the request's first `num_blocks` table blocks (those not freed yet), which no later query of it reads
        (they slid out of every layer's window); returns how many were freed now. Their table positions stay
        counted, so the request's later blocks keep their positions."""
        request_id = request.request_id
        blocks = self.req_blocks.get(request_id, [])
        num_freed = self.num_freed_blocks.get(request_id, 0)
        count = min(num_blocks - num_freed, len(blocks))
        if count <= 0:
            return 0
        self.pool.free(reversed(blocks[:count]))  # newest first, so the oldest are evicted last (as `free`)
        del blocks[:count]
        self.num_freed_blocks[request_id] = num_freed + count
        return count

    def _extend_block_hashes(self, request: Request) -> None:
        """Hash every full block of the request's known tokens that is not hashed yet (tokens only ever grow)."""
        hashes = request.block_hashes
        size = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // size):
            parent, salt = (hashes[i - 1], None) if i else (self.pool.root_hash, root_extra_key(request))
            hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size], salt))

    def _content(self, request: Request, index: int, parent_id: int) -> BlockContent:
        """What block `index` of the request holds, after the indexed block `parent_id` holding its prefix (the salt
        is the first block's alone: a later block's parent, unique per indexing, carries it)."""
        size = self.block_size
        salt = root_extra_key(request) if index == 0 else None
        return parent_id, tuple(request.all_token_ids[index * size : (index + 1) * size]), salt
