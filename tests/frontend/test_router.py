"""The data-parallel router: longest cached prefix wins, load breaks ties and overrides imbalance, tenants' salts
never match each other, the index stays bounded, and a request's n choices go to one replica."""

from __future__ import annotations

import pytest

from tokenmill.frontend.router import MAX_ROUTED_BLOCKS, PrefixIndex, PrefixKeys, Router

BLOCK = 4


def prompt(system: int, user: int, system_blocks: int = 8, user_tokens: int = 3) -> list[int]:
    """A shared 'system prompt' (system_blocks full blocks) then a few tokens of its own."""
    return [1000 * system + i for i in range(system_blocks * BLOCK)] + [
        50_000 + user * 10 + i for i in range(user_tokens)
    ]


def test_the_replica_holding_the_longest_prefix_wins():
    router = Router(3, BLOCK)
    homes = {system: router.route(prompt(system, 0)) for system in range(3)}
    assert sorted(homes.values()) == [0, 1, 2]  # no match anywhere: new prefixes spread by load
    for replica in range(3):
        router.release(replica)
    router.in_flight[homes[1]] = 5  # busier, but it holds the prefix: the cache wins below the balance threshold
    for user in range(1, 6):
        assert router.route(prompt(1, user)) == homes[1]
    assert router.decisions["prefix"][homes[1]] == 5
    # a request sharing only a longer part of one prefix than of another goes where more of it is cached
    partial = prompt(2, 0, system_blocks=8)[: 6 * BLOCK] + [7] * (10 * BLOCK)
    assert router.indexes[homes[2]].match(router.keys(partial)) == 6
    assert router.route(partial) == homes[2]


def test_a_new_prefix_goes_to_the_smallest_index_and_ties_to_the_least_loaded():
    router = Router(2, BLOCK)
    router.in_flight[:] = [3, 1]
    assert router.route(prompt(9, 0)) == 1  # both indexes empty: the least loaded
    router.in_flight[:] = [1, 5]
    assert router.route(prompt(8, 0)) == 0  # a new prefix: the replica caching less, though it is busier
    assert router.decisions["new-prefix"] == [1, 1]
    router.in_flight[:] = [1, 1]
    router.kv_usage[:] = [0.9, 0.2]
    assert router.route([5] * (BLOCK - 1)) == 1  # shorter than a block: by load, then the emptier KV cache
    assert router.decisions["load"] == [0, 1]
    # the same prefix indexed on both replicas: the less loaded of them
    router.indexes[0].add(router.keys(prompt(7, 0)))
    router.indexes[1].add(router.keys(prompt(7, 0)))
    router.in_flight[:] = [2, 4]
    router.kv_usage[:] = [0.0, 0.0]
    assert router.route(prompt(7, 1)) == 0


def test_a_short_match_or_an_imbalance_routes_by_load():
    router = Router(2, BLOCK, balance_abs_threshold=8, balance_rel_threshold=1.5)
    home = router.route(prompt(1, 0))
    other = 1 - home
    # a match of 2 blocks out of 20 is under the cache threshold (0.3): routed by load, the idle replica
    weak = prompt(1, 0, system_blocks=8)[: 2 * BLOCK] + [3] * (18 * BLOCK)
    assert router.route(weak) == other
    router.in_flight[home], router.in_flight[other] = 20, 2  # 18 apart and 10x: imbalanced
    assert router.route(prompt(1, 1)) == other
    assert router.decisions["balance"][other] == 1
    router.indexes[home].add(router.keys(prompt(3, 0)))  # a prefix only `home` holds
    router.in_flight[home], router.in_flight[other] = 9, 2  # 7 apart: within the absolute threshold
    assert router.route(prompt(3, 1)) == home


def test_cache_salts_isolate_tenants():
    keys = PrefixKeys(BLOCK)
    tokens = prompt(1, 0)
    assert keys(tokens, None) == keys(tokens, None)
    assert set(keys(tokens, "tenant-a")).isdisjoint(keys(tokens, "tenant-b"))
    assert set(keys(tokens, "tenant-a")).isdisjoint(keys(tokens, None))
    router = Router(2, BLOCK)
    home = router.route(tokens, "tenant-a")
    router.in_flight[home] += 3  # the same prompt from another tenant matches nothing: it goes by load
    assert router.route(tokens, "tenant-b") == 1 - home
    assert router.route(prompt(1, 1), "tenant-a") == home  # the owner still finds its prefix


def test_keys_chain_the_whole_prefix():
    keys = PrefixKeys(BLOCK)
    a, b = list(range(12)), [99] + list(range(1, 12))  # the same later blocks after a different first one
    assert keys(a)[0] != keys(b)[0] and not set(keys(a)) & set(keys(b))
    assert keys(a[:11]) == keys(a)[:2]  # only full blocks
    assert len(keys(list(range((MAX_ROUTED_BLOCKS + 5) * BLOCK)))) == MAX_ROUTED_BLOCKS


def test_the_index_is_bounded_and_evicts_a_prefix_tail_first():
    index = PrefixIndex(max_entries=10)
    keys = PrefixKeys(BLOCK)
    old = keys(list(range(8 * BLOCK)))
    index.add(old)
    for i in range(100):  # a client sending ever new prompts cannot grow it
        index.add(keys([10_000 + i] * (3 * BLOCK)))
        assert len(index) <= 10
    index = PrefixIndex(max_entries=10)
    index.add(old)
    index.add(keys([5] * (4 * BLOCK)))  # 12 keys for 10 entries: two of the old prefix go, from its tail
    assert index.match(old) == 6
    router = Router(1, BLOCK, max_index_entries=5)
    for i in range(50):
        router.route([i] * (20 * BLOCK))
    assert len(router.indexes[0]) == 5


def test_n_choices_go_to_one_replica_and_count_as_its_load():
    router = Router(2, BLOCK)
    replica = router.route(prompt(1, 0), num_choices=4)
    assert router.in_flight[replica] == 4 and router.in_flight[1 - replica] == 0
    router.release(replica, 4)
    assert router.in_flight == [0, 0]


def test_round_robin_and_dead_replicas():
    router = Router(3, BLOCK, policy="round-robin")
    assert [router.route(prompt(1, 0)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    router.set_alive(1, False)
    assert [router.route(prompt(1, 0)) for _ in range(4)] == [0, 2, 0, 2]
    cache_aware = Router(2, BLOCK)
    home = cache_aware.route(prompt(1, 0))
    cache_aware.set_alive(home, False)
    assert len(cache_aware.indexes[home]) == 0
    assert cache_aware.route(prompt(1, 1)) == 1 - home  # its prefix is gone with it
    cache_aware.set_alive(1 - home, False)
    with pytest.raises(RuntimeError, match="no data-parallel replica is alive"):
        cache_aware.route(prompt(1, 2))
    with pytest.raises(ValueError, match="data_parallel_routing"):
        Router(2, BLOCK, policy="random")
