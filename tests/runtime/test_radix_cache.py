"""Radix prefix cache over full KV pages: matching, splitting, locking, LRU eviction."""

from __future__ import annotations

import random

from sovereign_runtime.engine.block_manager import BlockPool
from sovereign_runtime.engine.radix_cache import RadixCache

BS = 4


def _cache(num_blocks: int = 64) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, BS)


def _store(pool: BlockPool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """What a finished sequence does: its pages go into the cache, then it drops its own references."""
    blocks = pool.allocate(len(tokens) // BS)
    cache.insert(tokens, blocks)
    pool.decref(blocks)
    return blocks


def test_match_returns_full_pages_only() -> None:
    pool, cache = _cache()
    toks = list(range(10))  # 2 full pages + 2 tokens
    blocks = _store(pool, cache, toks[:8])
    node, got = cache.match_prefix(toks)
    assert got == blocks and len(node.key) == 8
    _, got = cache.match_prefix(toks, max_tokens=7)  # only one full page fits in 7 tokens
    assert got == blocks[:1]
    _, got = cache.match_prefix([99, *toks])
    assert got == []
    cache.check()


def test_partial_match_splits_and_shares_the_common_pages() -> None:
    pool, cache = _cache()
    a = list(range(12))
    b = [*range(8), 50, 51, 52, 53]
    blocks_a = _store(pool, cache, a)
    node, got = cache.match_prefix(b)
    assert got == blocks_a[:2] and len(node.key) == 8  # the split upper node
    assert cache.insert(b, [*got, *pool.allocate(1)]) == 1  # only the differing page is new
    assert cache.num_cached_blocks == 4
    _, got_a = cache.match_prefix(a)
    assert got_a == blocks_a
    cache.check()
    pool.check()


def test_duplicate_insert_keeps_the_first_copy() -> None:
    pool, cache = _cache()
    first = _store(pool, cache, list(range(8)))
    dup = pool.allocate(2)
    assert cache.insert(list(range(8)), dup) == 0
    assert pool.decref(dup) == 2  # the duplicate is not referenced by the tree: freed at once
    assert cache.match_prefix(list(range(8)))[1] == first


def test_locked_prefix_is_not_evicted_and_lru_goes_first() -> None:
    pool, cache = _cache(num_blocks=6)
    old = _store(pool, cache, [1] * 8)  # 2 blocks, accessed first
    new = _store(pool, cache, [2] * 8)
    locked = _store(pool, cache, [3] * 8)
    node, _ = cache.match_prefix([3] * 8)
    cache.lock(node)
    cache.match_prefix([2] * 8)  # touch "new"
    assert cache.num_evictable_blocks == 4
    assert cache.evict(2) == 2
    assert cache.match_prefix([1] * 8)[1] == []  # least recently used went first
    assert cache.match_prefix([2] * 8)[1] == new
    assert cache.evict(100) == 2
    assert cache.match_prefix([3] * 8)[1] == locked  # locked survives
    assert pool.num_free == 4 and old[0] in pool._free
    cache.unlock(node)
    assert cache.evict(100) == 2 and pool.num_free == 6
    cache.check()


def test_eviction_walks_up_to_parents_that_become_leaves() -> None:
    pool, cache = _cache()
    _store(pool, cache, list(range(12)))
    _store(pool, cache, [*range(8), 7, 7, 7, 7])  # split: [0..8) -> {[8..12), [7777]}
    assert cache.num_cached_blocks == 4
    assert cache.evict(4) == 4
    assert cache.num_cached_blocks == 0 and pool.num_free == pool.num_blocks
    cache.check()


def test_hit_rate_counts_tokens() -> None:
    _, cache = _cache()
    cache.record_lookup(10, 8)
    cache.record_lookup(10, 0)
    assert cache.hit_rate == 0.4


def test_random_workload_invariants() -> None:
    rng = random.Random(1)
    pool, cache = _cache(num_blocks=40)
    users: list[tuple[object, list[int]]] = []  # (locked node, blocks we hold a reference to)
    for _ in range(600):
        op = rng.random()
        if op < 0.5:
            # A request: reuse the cached prefix, compute the rest, finish and cache it.
            prefix = [rng.randint(0, 2)] * BS * rng.randint(0, 3)
            tokens = prefix + [rng.randint(0, 3) for _ in range(BS * rng.randint(1, 3))]
            node, hit = cache.match_prefix(tokens)
            cache.lock(node)
            pool.incref(hit)
            need = len(tokens) // BS - len(hit)
            if pool.num_free < need:
                cache.evict(need - pool.num_free)
            if pool.num_free < need:
                cache.unlock(node)
                pool.decref(hit)
                continue
            mine = hit + pool.allocate(need)
            if rng.random() < 0.5:
                users.append((node, mine))  # still running
            else:
                cache.insert(tokens, mine)
                pool.decref(mine)
                cache.unlock(node)
        elif users:
            node, mine = users.pop(rng.randrange(len(users)))
            pool.decref(mine)
            cache.unlock(node)
        else:
            cache.evict(rng.randint(1, 5))
        cache.check()
        pool.check()
        held = {b for _, m in users for b in m}
        cached = {b for n in cache._nodes() for b in n.blocks}
        assert pool.num_used == len(held | cached)
    for node, mine in users:
        pool.decref(mine)
        cache.unlock(node)
    cache.reset()
    assert pool.num_free == pool.num_blocks and cache.root.lock_ref == 1
