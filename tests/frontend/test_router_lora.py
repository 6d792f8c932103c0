"""The data-parallel router's prefix keys include the LoRA adapter: the same prompt under another adapter (or the
base) matches nothing a replica was sent, as it would match nothing in that replica's prefix cache."""

from __future__ import annotations

from tokenmill.frontend.router import PrefixKeys, Router


def test_prefix_keys_differ_per_adapter_and_never_collide_with_a_salt():
    keys = PrefixKeys(block_size=4)
    tokens = list(range(40))
    base, one, two = keys(tokens), keys(tokens, lora_id=1), keys(tokens, lora_id=2)
    assert len(base) == len(one) == len(two) == 10
    assert not (set(base) & set(one)) and not (set(one) & set(two)) and not (set(base) & set(two))
    assert keys(tokens, lora_id=1) == one
    assert not set(keys(tokens, "1")) & set(one)  # a salt spelling the id is still another key


def test_a_prompt_routed_under_one_adapter_is_no_prefix_match_for_another():
    router = Router(2, block_size=4)
    tokens = list(range(64))
    first = router.route(tokens, lora_id=1)
    router.release(first)
    assert router.route(tokens, lora_id=1) == first and router.decisions["prefix"][first] == 1
    router.release(first)
    router.route(tokens, lora_id=2)
    assert sum(router.decisions["prefix"]) == 1  # not a prefix hit: a new prefix
    assert sum(router.decisions["new-prefix"]) == 2
