"""Pick the data-parallel replica for a request: longest cached prefix, then load (SGLang's cache-aware router).

The frontend cannot see the replicas' prefix caches, so it keeps an approximate index per replica of what it sent
there: the chained keys of every full prompt block (`block_size` tokens) it routed to that replica, in an LRU bounded
by about the replica's KV-cache size (a replica cannot hold more than that, and a client cannot grow the index
without limit). The key chain starts from a secret random root salted with the request's `cache_salt` and LoRA
adapter id, so requests of different tenants or adapters never match each other's prefixes here, as they cannot in the
schedulers' caches.

Choosing, with SGLang's defaults:
1. when the loads are imbalanced (max - min > `balance_abs_threshold` and max > min * `balance_rel_threshold`), the
   least-loaded replica;
2. otherwise, when some replica holds more than `cache_threshold` of the request's full blocks, the replica with the
   longest match (ties: the least loaded);
3. otherwise (a new prefix) the replica whose index is smallest, as SGLang picks the smallest radix tree: new
   prefixes spread over the replicas' caches instead of piling onto one; a prompt shorter than a block (nothing
   to cache) goes to the least loaded.
Ties left are broken by load, then KV-cache usage, then in turn. Load is the number of choices in flight on the
replica (the frontend's own count, exact and never a step late).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import msgspec

CACHE_THRESHOLD = 0.3  # SGLang router's defaults
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
MAX_ROUTED_BLOCKS = 1024  # leading blocks of a prompt that are hashed and indexed (16k tokens at block size 16)
MAX_INDEX_ENTRIES = 1 << 18  # per replica, whatever its KV cache: bounds the frontend's memory (~40 MiB)
KEY_BYTES = 16


class PrefixIndex:
    """One replica's prefix keys, least recently routed first; `max_entries` bounds it."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"a prefix index needs room for at least one entry, got {max_entries}")
        self.max_entries = max_entries
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of a request are indexed."""
        count = 0
        for key in keys:
            if key not in self._keys:
                break
            count += 1
        return count

    def add(self, keys: Sequence[bytes]) -> None:
        """Index (or refresh) a request's keys. Leaves first, so the root ends up most recent: eviction takes a
        prefix's tail before its head, as the scheduler's free queue does, and never strands a tail."""
        entries = self._keys
        for key in reversed(keys[-self.max_entries :]):
            if key in entries:
                entries.move_to_end(key)
            else:
                entries[key] = None
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()


class PrefixKeys:
    """The chained keys of a prompt's full blocks: keyed BLAKE2b, from a root secret to this process, salted."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._secret = os.urandom(32)

    def __call__(
        self, token_ids: Sequence[int], cache_salt: str | None = None, lora_id: int | None = None
    ) -> list[bytes]:
        size = self.block_size
        num_blocks = min(len(token_ids) // size, MAX_ROUTED_BLOCKS)
        if num_blocks == 0:
            return []
        data = array("q", token_ids[: num_blocks * size]).tobytes()
        salt = msgspec.msgpack.encode((cache_salt, lora_id))  # one unambiguous encoding of both
        parent = hashlib.blake2b(salt, key=self._secret, digest_size=KEY_BYTES).digest()
        keys = []
        stride = size * 8
        for i in range(num_blocks):
            parent = hashlib.blake2b(
                parent + data[i * stride : (i + 1) * stride], key=self._secret, digest_size=KEY_BYTES
            ).digest()
            keys.append(parent)
        return keys


class Router:
    """Chooses a replica per request and tracks each replica's in-flight choices.

    `route` picks and counts a request's `n` choices on one replica; `release` uncounts them as they end;
    `set_alive(r, False)` takes a dead replica out of rotation (and forgets its index).
    """

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        policy: str = "cache-aware",
        max_index_entries: int = MAX_INDEX_ENTRIES,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: float = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {num_replicas}")
        if policy not in ("cache-aware", "round-robin"):
            raise ValueError(f"data_parallel_routing must be 'cache-aware' or 'round-robin', got {policy!r}")
        self.policy = policy
        self.keys = PrefixKeys(block_size)
        self.indexes = [PrefixIndex(min(max_index_entries, MAX_INDEX_ENTRIES)) for _ in range(num_replicas)]
        self.in_flight = [0] * num_replicas
        self.kv_usage = [0.0] * num_replicas  # the replicas' latest reported KV-cache usage (0..1), a tie-breaker
        self.alive = [True] * num_replicas
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._turn = 0
        # why each request went where: "prefix", "new-prefix", "load", "balance" or "round-robin" -> per replica
        self.decisions: dict[str, list[int]] = {}

    @property
    def num_replicas(self) -> int:
        return len(self.indexes)

    def set_alive(self, replica: int, alive: bool) -> None:
        self.alive[replica] = alive
        if not alive:
            self.indexes[replica].clear()

    def route(
        self, token_ids: Sequence[int], cache_salt: str | None = None, num_choices: int = 1, lora_id: int | None = None
    ) -> int:
        """The replica for a request (all of its `num_choices` choices), counted in flight there until released;
        `lora_id`: its LoRA adapter's id (None: the base model). Raises RuntimeError when no replica is alive."""
        candidates = [r for r in range(self.num_replicas) if self.alive[r]]
        if not candidates:
            raise RuntimeError("no data-parallel replica is alive")
        if self.policy == "round-robin":
            replica, reason, keys = self._next_in_turn(candidates), "round-robin", None
        else:
            keys = self.keys(token_ids, cache_salt, lora_id)
            replica, reason = self._cache_aware(candidates, keys)
            self.indexes[replica].add(keys)
        self.in_flight[replica] += num_choices
        self.decisions.setdefault(reason, [0] * self.num_replicas)[replica] += 1
        return replica

    def release(self, replica: int, num_choices: int = 1) -> None:
        self.in_flight[replica] = max(0, self.in_flight[replica] - num_choices)

    def _cache_aware(self, candidates: list[int], keys: list[bytes]) -> tuple[int, str]:
        loads = self.in_flight
        least, most = min(loads[r] for r in candidates), max(loads[r] for r in candidates)
        if most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold:
            return self._least_loaded(candidates), "balance"
        if keys:
            matches = {r: self.indexes[r].match(keys) for r in candidates}
            best = max(matches.values())
            if best > self.cache_threshold * len(keys):
                return self._least_loaded([r for r in candidates if matches[r] == best]), "prefix"
        else:  # shorter than a block: nothing to cache or to match
            return self._least_loaded(candidates), "load"
        smallest = min(len(self.indexes[r]) for r in candidates)
        return self._least_loaded([r for r in candidates if len(self.indexes[r]) == smallest]), "new-prefix"

    def _least_loaded(self, candidates: list[int]) -> int:
        def rank(r: int) -> tuple:
            return self.in_flight[r], round(self.kv_usage[r], 2), (r - self._turn) % self.num_replicas

        replica = min(candidates, key=rank)
        self._turn = replica + 1
        return replica

    def _next_in_turn(self, candidates: list[int]) -> int:
        replica = min(candidates, key=lambda r: (r - self._turn) % self.num_replicas)
        self._turn = replica + 1
        return replica
