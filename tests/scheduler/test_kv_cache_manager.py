"""Unit tests of the KV cache manager: slot allocation, prefix lookup rules, caching computed blocks, freeing."""

from tests.helpers.sched_testing import make_request
from tokenmill.scheduler import kv_cache_manager
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.request import Request

BLOCK = 4


def new_request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(make_request(request_id, tokens, cache_salt=salt), arrival_seq=0, enqueue_time=0.0, max_tokens=4)


def compute_all(kv: KVCacheManager, req: Request) -> None:
    """Allocate and 'compute' every token of the request, then index its full blocks."""
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def test_allocation_covers_the_tokens_and_grows_a_block_at_a_time():
    kv = KVCacheManager(8, BLOCK)
    req = new_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 1) == []  # token 11 still fits block 2
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1) == [3]
    assert kv.block_ids("a") == [0, 1, 2, 3]


def test_lookahead_slots_are_allocated_but_not_cached():
    """num_lookahead_tokens: blocks past the new tokens (the draft model's KV writes), all or nothing, never
    indexed in the prefix cache since no computed token lands in them."""
    kv = KVCacheManager(4, BLOCK)
    req = new_request("a", list(range(8)))
    assert kv.allocate_slots(req, 8, num_lookahead_tokens=9) is None  # 17 slots: 5 blocks > 4
    assert "a" not in kv.req_blocks
    assert kv.allocate_slots(req, 8, num_lookahead_tokens=3) == [0, 1, 2]
    req.num_computed_tokens = 8
    kv.cache_computed_blocks(req)
    assert kv.num_indexed_blocks["a"] == 2


def test_allocation_fails_without_side_effects_when_short():
    kv = KVCacheManager(2, BLOCK)
    req = new_request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert kv.pool.num_free_blocks == 2 and "a" not in kv.req_blocks


def test_prefix_hit_reuses_full_blocks_and_leaves_the_last_token_to_compute():
    kv = KVCacheManager(16, BLOCK)
    first = new_request("a", list(range(10)))
    compute_all(kv, first)
    same = new_request("b", list(range(10)))
    hits = kv.find_cached_prefix(same)
    assert [b.block_id for b in hits] == kv.block_ids("a")[:2]  # the partial third block is never shared
    # a prompt of exactly two blocks may reuse only the first: its last token must be recomputed
    two_blocks = new_request("c", list(range(8)))
    assert len(kv.find_cached_prefix(two_blocks)) == 1
    # a prompt that diverges in the second block shares only the first
    diverging = new_request("d", list(range(5)) + [99, 98, 97, 96, 95])
    assert len(kv.find_cached_prefix(diverging)) == 1


def test_hits_are_shared_with_reference_counts():
    kv = KVCacheManager(16, BLOCK)
    first = new_request("a", list(range(10)))
    compute_all(kv, first)
    second = new_request("b", list(range(10)))
    hits = kv.find_cached_prefix(second)
    added = kv.allocate_slots(second, 2, hits)
    assert added[:2] == kv.block_ids("a")[:2] and len(added) == 3
    assert [b.ref_count for b in kv.req_blocks["a"]] == [2, 2, 1]
    kv.free(first)
    assert [b.ref_count for b in kv.req_blocks["b"]] == [1, 1, 1]


def test_salt_separates_identical_prompts():
    kv = KVCacheManager(16, BLOCK)
    compute_all(kv, new_request("a", list(range(10)), salt="alice"))
    assert kv.find_cached_prefix(new_request("b", list(range(10)), salt="bob")) == []
    assert len(kv.find_cached_prefix(new_request("c", list(range(10)), salt="alice"))) == 2


def test_salt_is_hashed_once_into_the_first_block_only(monkeypatch):
    """The salt enters the chain at its root (vLLM's rule), so a long salt costs one block's hash, not every one's."""
    seen: list[str | None] = []
    real = kv_cache_manager.hash_block

    def recording_hash(parent: bytes, token_ids: list[int], extra_key: str | None) -> bytes:
        seen.append(extra_key)
        return real(parent, token_ids, extra_key)

    monkeypatch.setattr(kv_cache_manager, "hash_block", recording_hash)
    kv = KVCacheManager(16, BLOCK)
    salted = new_request("a", list(range(4 * BLOCK)), salt="s" * 256)
    compute_all(kv, salted)
    assert seen == ["s" * 256, None, None, None]
    assert [content[2] for content in (b.content for b in kv.req_blocks["a"])] == ["s" * 256, None, None, None]
    # the salt still separates every block of the chain: another salt hits nothing, the same salt all but the last
    assert kv.find_cached_prefix(new_request("b", list(range(4 * BLOCK)), salt="t" * 256)) == []
    assert len(kv.find_cached_prefix(new_request("c", list(range(4 * BLOCK)), salt="s" * 256))) == 3


def test_freed_blocks_stay_cached_until_reallocated_and_tail_goes_first():
    kv = KVCacheManager(4, BLOCK)
    first = new_request("a", list(range(12)))
    compute_all(kv, first)  # three full blocks: 0, 1, 2
    kv.free(first)
    assert kv.pool.num_free_blocks == 4
    # blocks were freed tail first, so a fresh allocation evicts the unused block, then block 2, keeping 0 and 1
    other = new_request("x", [500 + i for i in range(8)])
    assert kv.allocate_slots(other, 8) == [3, 2]
    again = new_request("b", list(range(12)))
    assert [b.block_id for b in kv.find_cached_prefix(again)] == [0, 1]


def test_hits_in_the_free_queue_count_against_free_blocks():
    kv = KVCacheManager(3, BLOCK)
    first = new_request("a", list(range(9)))
    compute_all(kv, first)  # blocks 0,1 full and cached, block 2 partial
    kv.free(first)
    second = new_request("b", list(range(9)) + [50, 51, 52, 53, 54, 55, 56])  # 16 tokens: 4 blocks
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 2
    assert kv.allocate_slots(second, 8, hits) is None  # 2 hits + 2 fresh > 3 blocks
    assert kv.allocate_slots(second, 4, hits) == [0, 1, 2]
    assert kv.pool.num_free_blocks == 0


def test_generated_tokens_fill_blocks_that_become_cached():
    kv = KVCacheManager(8, BLOCK)
    req = new_request("a", [1, 2, 3])
    compute_all(kv, req)
    req.all_token_ids.append(4)  # a sampled token completes block 0
    assert kv.allocate_slots(req, 1) == []
    req.num_computed_tokens = 4
    kv.cache_computed_blocks(req)
    follower = new_request("b", [1, 2, 3, 4, 5])
    assert [b.block_id for b in kv.find_cached_prefix(follower)] == [0]


def test_uncomputed_blocks_are_not_shared():
    kv = KVCacheManager(8, BLOCK)
    req = new_request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is not None
    kv.cache_computed_blocks(req)  # nothing computed yet
    assert kv.find_cached_prefix(new_request("b", list(range(12)))) == []


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=False)
    compute_all(kv, new_request("a", list(range(10))))
    assert kv.find_cached_prefix(new_request("b", list(range(10)))) == []


# ---------------------------------------------------------------- colliding keys (vLLM CVE-2025-25183)


def collide_every_key(monkeypatch) -> None:
    """Every block of every request gets the same key: the worst a hash collision can do."""
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda parent, token_ids, extra_key: b"\0" * 32)


def test_colliding_keys_do_not_share_blocks_between_different_tokens(monkeypatch):
    collide_every_key(monkeypatch)
    kv = KVCacheManager(16, BLOCK)
    victim = new_request("victim", list(range(10)))
    compute_all(kv, victim)
    attacker = new_request("attacker", [90, 91, 92, 93] + list(range(4, 10)))
    assert kv.find_cached_prefix(attacker) == []
    # a key-only index (the old scheme) would have handed the attacker the victim's first block
    assert kv.pool.cached[attacker.block_hashes[0]] is kv.req_blocks["victim"][0]


def test_colliding_keys_do_not_share_a_block_at_another_position(monkeypatch):
    collide_every_key(monkeypatch)
    kv = KVCacheManager(16, BLOCK)
    compute_all(kv, new_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # its first block's tokens again as a second block: same tokens, but KV computed after another prefix
    repeated = new_request("b", [1, 2, 3, 4, 1, 2, 3, 4, 9])
    assert [b.block_id for b in kv.find_cached_prefix(repeated)] == [kv.block_ids("a")[0]]


def test_colliding_keys_still_separate_salts(monkeypatch):
    collide_every_key(monkeypatch)
    kv = KVCacheManager(16, BLOCK)
    compute_all(kv, new_request("a", list(range(10)), salt="alice"))
    assert kv.find_cached_prefix(new_request("b", list(range(10)), salt="bob")) == []
    assert len(kv.find_cached_prefix(new_request("c", list(range(10)), salt="alice"))) == 1  # one key, one block


def test_identical_prefixes_hash_differently_in_two_managers():
    first, second = KVCacheManager(8, BLOCK), KVCacheManager(8, BLOCK)
    a, b = new_request("a", list(range(8))), new_request("b", list(range(8)))
    compute_all(first, a)
    compute_all(second, b)
    assert len(a.block_hashes) == 2 and not set(a.block_hashes) & set(b.block_hashes)
