"""BlockPool: allocation, reference counts, free order (uncached first, cached LRU), prefix-cache map, invariants.

Pure Python, no torch, no model: the whole file runs in well under a second.
"""
from __future__ import annotations

import random

import pytest

from pdserve.core.block_pool import NULL_BLOCK, BlockPool, hash_block


def H(i: int) -> bytes:
    """A distinct, deterministic block hash per integer."""
    return hash_block(None, [i])


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


# --------------------------------------------------------------------------------------------------------------------
# construction, allocation, ref counts


@pytest.mark.parametrize("n", [-1, 0, 1])
def test_too_few_blocks_rejected(n):
    with pytest.raises(ValueError):
        BlockPool(n)


def test_fresh_pool():
    pool = BlockPool(8)
    assert pool.num_usable_blocks == 7
    assert pool.num_free_blocks == 7
    assert pool.num_cached_free_blocks == 0
    assert pool.usage() == 0.0
    assert NULL_BLOCK not in pool.free_queue
    pool.check_invariants([])


def test_allocate_sets_ref_and_leaves_free_queue():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert blocks == [1, 2, 3]  # fresh pool hands out from the front, in order
    assert all(pool.ref_cnt[b] == 1 for b in blocks)
    assert not any(b in pool.free_queue for b in blocks)
    assert pool.num_free_blocks == 4
    assert pool.usage() == pytest.approx(3 / 7)
    assert pool.allocate(0) == []
    pool.check_invariants([blocks])


def test_null_block_never_handed_out():
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    assert sorted(blocks) == [1, 2, 3, 4, 5]
    assert NULL_BLOCK not in blocks
    assert pool.usage() == 1.0
    pool.check_invariants([blocks])
    # free and reallocate a few times: still never block 0
    for _ in range(3):
        pool.free(blocks)
        blocks = pool.allocate(5)
        assert NULL_BLOCK not in blocks
    assert pool.ref_cnt[NULL_BLOCK] == 0


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(5)
    a = pool.allocate(2)
    before = (list(pool.ref_cnt), free_order(pool))
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert (list(pool.ref_cnt), free_order(pool)) == before
    pool.check_invariants([a])
    assert len(pool.allocate(2)) == 2
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_free_decrements_and_double_free_asserts():
    pool = BlockPool(5)
    a = pool.allocate(2)
    pool.free(a)
    assert all(pool.ref_cnt[b] == 0 for b in a)
    assert pool.num_free_blocks == 4
    pool.check_invariants([])
    with pytest.raises(AssertionError):
        pool.free([a[0]])


def test_freeing_null_block_asserts():
    pool = BlockPool(4)
    with pytest.raises(AssertionError):
        pool.free([NULL_BLOCK])


def test_shared_block_stays_allocated_until_last_owner_frees():
    pool = BlockPool(6)
    a = pool.allocate(2)
    pool.cache_block(a[0], H(1))
    hit = pool.lookup(H(1))
    assert hit == a[0]
    pool.touch([hit])  # second owner
    b = [hit] + pool.allocate(1)
    assert pool.ref_cnt[hit] == 2
    pool.check_invariants([a, b])
    pool.free(reversed(a))
    assert pool.ref_cnt[hit] == 1 and hit not in pool.free_queue
    pool.check_invariants([b])
    pool.free(reversed(b))
    assert pool.ref_cnt[hit] == 0 and hit in pool.free_queue
    assert pool.lookup(H(1)) == hit  # still cached while free
    pool.check_invariants([])


# --------------------------------------------------------------------------------------------------------------------
# free order and eviction


def test_uncached_freed_blocks_reused_before_cached_ones():
    pool = BlockPool(5)  # blocks 1..4
    blocks = pool.allocate(4)
    pool.cache_block(1, H(1))
    pool.cache_block(2, H(2))
    pool.free(reversed(blocks))  # tail first: 4, 3 (uncached, to the front), 2, 1 (cached, to the back)
    assert pool.num_cached_free_blocks == 2
    order = free_order(pool)
    assert set(order[:2]) == {3, 4} and set(order[2:]) == {1, 2}
    first = pool.allocate(2)
    assert set(first) == {3, 4}
    # cached blocks survive as long as uncached ones remain
    assert pool.lookup(H(1)) == 1 and pool.lookup(H(2)) == 2
    pool.check_invariants([first])


def test_uncached_blocks_freed_tail_first_put_head_first():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    pool.free(reversed(blocks))
    assert free_order(pool) == [1, 2, 3, 4]


def test_cached_free_blocks_evicted_lru_oldest_first():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    for b in blocks:
        pool.cache_block(b, H(b))
    # free in the order 3, 1, 4, 2: that is LRU age order
    for b in (3, 1, 4, 2):
        pool.free([b])
    assert free_order(pool) == [3, 1, 4, 2]
    assert pool.num_cached_free_blocks == 4
    got = []
    for _ in range(4):
        got += pool.allocate(1)
        pool.check_invariants([got])
    assert got == [3, 1, 4, 2]
    # every evicted block lost its hash mapping
    assert all(pool.lookup(H(b)) is None for b in blocks)
    assert all(pool.block_hash[b] is None for b in blocks)
    assert pool.cached == {}


def test_touch_and_refree_makes_block_most_recent():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for b in blocks:
        pool.cache_block(b, H(b))
    pool.free(blocks)  # LRU order 1, 2, 3
    pool.touch([pool.lookup(H(1))])
    pool.free([1])  # block 1 is now the most recently used
    assert free_order(pool) == [2, 3, 1]
    assert pool.allocate(1) == [2]
    pool.check_invariants([[2]])


def test_touch_cached_free_block_removes_it_from_free_queue():
    pool = BlockPool(5)
    a = pool.allocate(2)
    pool.cache_block(a[0], H(7))
    pool.free(reversed(a))
    assert a[0] in pool.free_queue
    n_free = pool.num_free_blocks
    hit = pool.lookup(H(7))
    assert hit == a[0]
    pool.touch([hit])
    assert hit not in pool.free_queue
    assert pool.ref_cnt[hit] == 1
    assert pool.num_free_blocks == n_free - 1
    assert pool.lookup(H(7)) == hit  # still published
    pool.check_invariants([[hit]])
    # it cannot be handed out while touched
    rest = pool.allocate(pool.num_free_blocks)
    assert hit not in rest
    pool.check_invariants([[hit], rest])


def test_eviction_removes_hash_mapping():
    pool = BlockPool(3)  # blocks 1, 2
    a = pool.allocate(1)
    pool.cache_block(a[0], H(1))
    pool.free(a)
    assert pool.lookup(H(1)) == a[0]
    b = pool.allocate(2)  # block 2 (uncached) first, then the cached one is evicted and reused
    assert b == [2, a[0]]
    assert pool.lookup(H(1)) is None
    assert pool.block_hash[a[0]] is None
    assert H(1) not in pool.cached
    pool.check_invariants([b])


def test_same_hash_published_twice_keeps_first_block():
    pool = BlockPool(5)
    a, b = pool.allocate(2)
    pool.cache_block(a, H(1))
    pool.cache_block(b, H(1))
    assert pool.lookup(H(1)) == a
    assert pool.block_hash[b] is None
    # freeing the duplicate is an uncached free: it goes to the front, and the published one stays
    pool.free([b])
    assert free_order(pool)[0] == b
    pool.allocate(1)
    assert pool.lookup(H(1)) == a
    pool.check_invariants([[a], [b]])


def test_republishing_a_block_under_another_hash_is_ignored():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache_block(a, H(1))
    pool.cache_block(a, H(2))
    assert pool.block_hash[a] == H(1)
    assert pool.lookup(H(2)) is None
    pool.check_invariants([[a]])


def test_caching_disabled_never_hits():
    pool = BlockPool(5, enable_caching=False)
    blocks = pool.allocate(4)
    for b in blocks:
        pool.cache_block(b, H(b))
    assert pool.cached == {}
    assert all(pool.block_hash[b] is None for b in blocks)
    assert all(pool.lookup(H(b)) is None for b in blocks)
    pool.free(reversed(blocks))
    assert pool.num_cached_free_blocks == 0
    assert free_order(pool) == [1, 2, 3, 4]
    pool.check_invariants([])


def test_reset_prefix_cache_drops_only_free_blocks():
    pool = BlockPool(5)
    a = pool.allocate(2)
    pool.cache_block(a[0], H(1))
    pool.cache_block(a[1], H(2))
    pool.free([a[1]])
    pool.reset_prefix_cache()
    assert pool.lookup(H(2)) is None and pool.block_hash[a[1]] is None
    assert pool.lookup(H(1)) == a[0]  # in use: stays published
    assert pool.num_cached_free_blocks == 0
    pool.check_invariants([[a[0]]])


def test_hash_block_is_chained_and_deterministic():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert h1 == hash_block(None, [1, 2, 3, 4])
    assert h1 != hash_block(None, [1, 2, 3, 5])
    assert hash_block(h1, [5, 6]) != hash_block(None, [5, 6])
    assert hash_block(h1, [5, 6]) != hash_block(hash_block(None, [9]), [5, 6])
    assert hash_block(h1, (5, 6)) == hash_block(h1, iter([5, 6]))


# --------------------------------------------------------------------------------------------------------------------
# check_invariants must be able to fail


def _good_state():
    """Two owners sharing one cached block, one cached free block, one uncached free block."""
    pool = BlockPool(7)
    a = pool.allocate(3)
    for i, blk in enumerate(a):
        pool.cache_block(blk, H(100 + i))
    pool.touch([a[0]])
    b = [a[0]] + pool.allocate(1)
    pool.free([a[2]])  # a[2] becomes a cached free block
    a = a[:2]
    pool.check_invariants([a, b])
    return pool, a, b


def test_checker_passes_on_good_state():
    pool, a, b = _good_state()
    pool.check_invariants([a, b])
    pool.check_invariants(iter([a, b]))  # any iterable of lists


def _corrupt_bump_ref(pool, a, b):
    pool.ref_cnt[a[1]] += 1
    return [a, b]


def _corrupt_drop_ref(pool, a, b):
    pool.ref_cnt[a[0]] -= 1
    return [a, b]


def _owner_missing(pool, a, b):
    return [a]


def _owner_extra(pool, a, b):
    return [a, b, [a[1]]]


def _owner_holds_free_block(pool, a, b):
    free_block = next(iter(pool.free_queue))
    return [a, b + [free_block]]


def _owner_holds_null_block(pool, a, b):
    return [a, b + [NULL_BLOCK]]


def _null_ref(pool, a, b):
    pool.ref_cnt[NULL_BLOCK] = 1
    return [a, b, [NULL_BLOCK]]


def _null_in_free_queue(pool, a, b):
    pool.free_queue[NULL_BLOCK] = None
    return [a, b]


def _null_hashed(pool, a, b):
    pool.block_hash[NULL_BLOCK] = H(999)
    return [a, b]


def _used_block_in_free_queue(pool, a, b):
    pool.free_queue[a[1]] = None
    return [a, b]


def _free_block_missing_from_queue(pool, a, b):
    pool.free_queue.popitem(last=True)
    return [a, b]


def _hash_map_points_at_wrong_block(pool, a, b):
    pool.cached[H(100)] = a[1]
    return [a, b]


def _hash_map_stale_after_eviction(pool, a, b):
    blk = pool.cached[H(102)]
    pool.block_hash[blk] = None  # block lost its hash but the map still points at it
    return [a, b]


@pytest.mark.parametrize("corrupt", [
    _corrupt_bump_ref, _corrupt_drop_ref, _owner_missing, _owner_extra, _owner_holds_free_block,
    _owner_holds_null_block, _null_ref, _null_in_free_queue, _null_hashed, _used_block_in_free_queue,
    _free_block_missing_from_queue, _hash_map_points_at_wrong_block, _hash_map_stale_after_eviction,
], ids=lambda f: f.__name__.strip("_"))
def test_checker_detects_corruption(corrupt):
    pool, a, b = _good_state()
    owners = corrupt(pool, a, b)
    with pytest.raises(AssertionError):
        pool.check_invariants(owners)


# --------------------------------------------------------------------------------------------------------------------
# randomized property test


def _check_free_queue_shape(pool: BlockPool) -> None:
    """Uncached free blocks all come before cached free blocks (so none is evicted while an uncached one is left)."""
    flags = [pool.block_hash[b] is not None for b in pool.free_queue]
    assert flags == sorted(flags), f"cached block ahead of an uncached one in the free queue: {flags}"


@pytest.mark.parametrize("seed,enable_caching", [(0, True), (1, True), (2, False)])
def test_random_ops_keep_invariants(seed, enable_caching):
    rng = random.Random(seed)
    pool = BlockPool(17, enable_caching=enable_caching)
    owners: dict[int, list[int]] = {}
    hashes = [H(i) for i in range(24)]  # a small universe, so collisions and duplicate publishes happen
    lru: list[int] = []  # model of the cached part of the free queue, oldest first
    stats = dict.fromkeys(("alloc", "touch_free", "touch_used", "free", "cache", "evict", "reset", "fail"), 0)
    next_owner = 0

    for _ in range(4000):
        op = rng.random()
        if op < 0.35:  # allocate into a new or existing owner
            n = rng.randint(1, 4)
            if n > pool.num_free_blocks:
                with pytest.raises(RuntimeError):
                    pool.allocate(n)
                stats["fail"] += 1
            else:
                expected = list(pool.free_queue)[:n]
                evicting = [b for b in expected if pool.block_hash[b] is not None]
                if any(pool.block_hash[b] is None for b in pool.free_queue):
                    assert pool.block_hash[expected[0]] is None
                got = pool.allocate(n)
                assert got == expected
                assert NULL_BLOCK not in got
                for b in got:
                    assert pool.ref_cnt[b] == 1 and pool.block_hash[b] is None
                assert lru[:len(evicting)] == evicting  # cached ones leave oldest first
                del lru[:len(evicting)]
                stats["evict"] += len(evicting)
                if owners and rng.random() < 0.5:
                    owners[rng.choice(list(owners))].extend(got)
                else:
                    owners[next_owner] = got
                    next_owner += 1
                stats["alloc"] += 1
        elif op < 0.55:  # cache hit: take another reference on a published block
            h = rng.choice(hashes)
            b = pool.lookup(h)
            if not enable_caching:
                assert b is None
            if b is not None:
                assert pool.block_hash[b] == h
                was_free = pool.ref_cnt[b] == 0
                n_free = pool.num_free_blocks
                pool.touch([b])
                if was_free:
                    assert b not in pool.free_queue and pool.num_free_blocks == n_free - 1
                    lru.remove(b)
                    stats["touch_free"] += 1
                else:
                    stats["touch_used"] += 1
                owners.setdefault(next_owner, []).append(b)
                next_owner += 1
        elif op < 0.8:  # an owner finishes: free its blocks tail first
            if owners:
                k = rng.choice(list(owners))
                blocks = owners.pop(k)
                pool.free(reversed(blocks))
                for b in reversed(blocks):
                    if pool.ref_cnt[b] == 0 and pool.block_hash[b] is not None:
                        lru.append(b)
                for b in blocks:
                    if pool.ref_cnt[b] == 0:
                        assert b in pool.free_queue
                stats["free"] += 1
        elif op < 0.98:  # publish an owned block
            if owners:
                blocks = owners[rng.choice(list(owners))]
                b = rng.choice(blocks)
                h = rng.choice(hashes)
                prev_block, prev_hash = pool.lookup(h), pool.block_hash[b]
                pool.cache_block(b, h)
                if not enable_caching:
                    assert pool.block_hash[b] is None
                elif prev_hash is not None:
                    assert pool.block_hash[b] == prev_hash  # already published: unchanged
                elif prev_block is not None:
                    assert pool.lookup(h) == prev_block and pool.block_hash[b] is None  # first one kept
                else:
                    assert pool.lookup(h) == b
                stats["cache"] += 1
        else:
            pool.reset_prefix_cache()
            assert pool.num_cached_free_blocks == 0
            lru.clear()
            stats["reset"] += 1

        pool.check_invariants(owners.values())
        _check_free_queue_shape(pool)
        assert [b for b in pool.free_queue if pool.block_hash[b] is not None] == lru
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h
        for b in range(1, pool.num_blocks):
            if pool.block_hash[b] is not None:
                assert pool.cached[pool.block_hash[b]] == b

    for blocks in owners.values():
        pool.free(reversed(blocks))
    pool.check_invariants([])
    assert pool.num_free_blocks == pool.num_usable_blocks

    # the walk really exercised the interesting paths
    assert stats["alloc"] > 500 and stats["free"] > 500 and stats["fail"] > 10
    if enable_caching:
        assert stats["touch_free"] > 20 and stats["touch_used"] > 20 and stats["evict"] > 20
