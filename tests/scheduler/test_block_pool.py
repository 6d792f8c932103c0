"""Unit tests of the block pool: LRU free queue, reference counts, hash chain and prefix-cache eviction."""

import pytest

from tokenmill.scheduler.block_pool import ROOT_CONTENT_ID, BlockContent, BlockPool, hash_block

ROOT = bytes(32)


def content(*token_ids: int, parent_id: int = ROOT_CONTENT_ID, salt: str | None = None) -> BlockContent:
    return parent_id, token_ids, salt


def test_allocation_takes_least_recently_freed_blocks_first():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    assert [x.block_id for x in (a, b, c, d)] == [0, 1, 2, 3]
    assert pool.num_free_blocks == 0
    pool.free([c])
    pool.free([a])
    pool.free([d])
    assert [blk.block_id for blk in pool.allocate(2)] == [2, 0]
    assert [blk.block_id for blk in pool.allocate(1)] == [3]


def test_reference_counts_keep_shared_blocks_out_of_the_free_queue():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert block.ref_count == 0 and pool.num_free_blocks == 2
    with pytest.raises(ValueError):
        pool.free([block])


def test_allocating_more_than_free_raises():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.allocate(2)


def test_hash_chains_parent_tokens_and_salt():
    first = hash_block(ROOT, [1, 2, 3, 4], None)
    assert first == hash_block(ROOT, (1, 2, 3, 4), None)
    assert first != hash_block(ROOT, [1, 2, 3, 5], None)
    assert first != hash_block(ROOT, [1, 2, 3, 4], "tenant-a")
    assert hash_block(ROOT, [1, 2, 3, 4], "a") != hash_block(ROOT, [1, 2, 3, 4], "b")
    # same tokens under a different parent is different content
    second = hash_block(first, [5, 6, 7, 8], None)
    other_parent = hash_block(hash_block(ROOT, [9, 9, 9, 9], None), [5, 6, 7, 8], None)
    assert second != other_parent


def test_freed_cached_block_is_reclaimed_on_a_hit():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    assert pool.cache(block, b"k", content(1)) is block
    pool.free([block])
    assert pool.num_free_blocks == 3
    assert pool.get_cached(b"k", content(1)) is block  # still indexed while free
    pool.touch([block])
    assert block.ref_count == 1
    assert block.block_id not in pool.free_queue
    assert pool.num_free_blocks == 2


def test_reallocating_a_cached_block_evicts_its_hash():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache(first, b"k11", content(11))
    pool.cache(second, b"k22", content(22))
    pool.free([first])  # first is now the least recently freed
    pool.free([second])
    (reused,) = pool.allocate(1)
    assert reused is first
    assert reused.hash is None
    assert reused.content is None
    assert pool.get_cached(b"k11", content(11)) is None
    assert pool.get_cached(b"k22", content(22)) is second


def test_duplicate_content_keeps_the_first_block_indexed():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"k", content(5)) is a
    assert pool.cache(b, b"k", content(5)) is a  # the holder of that content, kept
    assert pool.get_cached(b"k", content(5)) is a
    assert b.hash is None
    pool.free([a, b])
    # evicting the unindexed duplicate must not drop the indexed block's entry
    pool.free_queue.move_to_end(a.block_id)
    assert pool.allocate(1) == [b]
    assert pool.get_cached(b"k", content(5)) is a


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    assert pool.cache(block, b"k", content(9)) is None
    assert block.hash is None and pool.get_cached(b"k", content(9)) is None


def test_usage_counts_referenced_blocks():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.usage == pytest.approx(0.75)
    pool.free(blocks)
    assert pool.usage == 0.0


def test_keys_are_sha256_chained_from_a_random_root_per_pool():
    first, second = BlockPool(4), BlockPool(4)
    assert len(first.root_hash) == 32 and first.root_hash != second.root_hash
    key = hash_block(first.root_hash, [1, 2, 3, 4], None)
    assert len(key) == 32 and key != hash_block(second.root_hash, [1, 2, 3, 4], None)


def test_a_key_held_by_other_content_is_a_miss_and_is_not_taken_over():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"same-key", content(1, 2)) is a
    assert pool.get_cached(b"same-key", content(3, 4)) is None  # other tokens
    assert pool.get_cached(b"same-key", content(1, 2, salt="tenant-b")) is None  # other salt
    assert pool.get_cached(b"same-key", content(1, 2, parent_id=a.content_id)) is None  # other prefix
    assert pool.cache(b, b"same-key", content(3, 4)) is None
    assert b.hash is None and pool.get_cached(b"same-key", content(1, 2)) is a


def test_a_reindexed_block_gets_a_new_content_id():
    pool = BlockPool(1)
    (block,) = pool.allocate(1)
    pool.cache(block, b"k1", content(1))
    old_id = block.content_id
    pool.free([block])
    (block,) = pool.allocate(1)  # evicts it
    pool.cache(block, b"k2", content(2))
    assert block.content_id != old_id  # children recorded under old_id can never match the new content
