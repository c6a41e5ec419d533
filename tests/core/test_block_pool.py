"""BlockPool on its own: reference counts, the LRU free queue that keeps cached blocks until reuse, the prefix-cache
hash table, reset and usage counters (plain Python, no model)."""

from __future__ import annotations

import random

from leanserve.core.block_pool import BlockPool, KVCacheBlock

import pytest


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_order(pool: BlockPool) -> list[int]:
    """Block ids in the order the next allocations will take them."""
    return list(pool.free_queue)


def check_invariant(pool: BlockPool) -> None:
    """The documented invariant: ref_cnt == 0 exactly for the blocks in the free queue; the hash table and the
    blocks' hashes agree."""
    in_queue = {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert set(pool.free_queue) == in_queue
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    assert all(pool.free_queue[i] is pool.blocks[i] for i in pool.free_queue)
    for h, b in pool.cached.items():
        assert b.block_hash == h
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)


@pytest.mark.parametrize("n", [0, -3])
def test_pool_needs_at_least_one_block(n):
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(n)


def test_fresh_pool_is_all_free_in_id_order():
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.num_free_blocks == 5 and pool.num_cached_free_blocks == 0
    assert pool.usage == 0.0
    assert free_order(pool) == [0, 1, 2, 3, 4]
    assert [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks] == [(i, 0, None) for i in range(5)]
    assert pool.cached == {}


def test_allocate_takes_from_the_head_with_one_reference():
    pool = BlockPool(5)
    a = pool.allocate(2)
    assert ids(a) == [0, 1] and [b.ref_cnt for b in a] == [1, 1]
    assert a[0] is pool.blocks[0] and a[1] is pool.blocks[1]
    b = pool.allocate(3)
    assert ids(b) == [2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    check_invariant(pool)


def test_allocate_zero_blocks_changes_nothing():
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 3 and free_order(pool) == [0, 1, 2]


def test_allocate_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(ValueError, match="asked for 2 blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1 and free_order(pool) == [3]  # no partial allocation
    assert [b.ref_cnt for b in held] == [1, 1, 1] and pool.blocks[3].ref_cnt == 0
    assert ids(pool.allocate(1)) == [3]
    with pytest.raises(ValueError, match="asked for 1 blocks, only 0 free"):
        pool.allocate(1)


def test_usage_is_fraction_of_held_blocks():
    pool = BlockPool(8)
    a = pool.allocate(2)
    assert pool.usage == pytest.approx(2 / 8)
    pool.touch(a)  # a second holder of the same blocks does not use more of the pool
    assert pool.usage == pytest.approx(2 / 8)
    b = pool.allocate(4)
    assert pool.usage == pytest.approx(6 / 8)
    pool.free(b)
    pool.free(a)
    assert pool.usage == pytest.approx(2 / 8)  # a still has one reference each
    pool.free(a)
    assert pool.usage == 0.0


def test_shared_block_returns_to_the_queue_only_with_its_last_reference():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.touch([b])
    assert b.ref_cnt == 3 and pool.num_free_blocks == 2
    pool.free([b])
    pool.free([b])
    assert b.ref_cnt == 1 and b.block_id not in pool.free_queue
    pool.free([b])
    assert b.ref_cnt == 0 and free_order(pool) == [1, 2, 0]  # joined the tail
    check_invariant(pool)


def test_freed_blocks_join_the_tail_in_the_given_order():
    pool = BlockPool(6)
    a = pool.allocate(6)
    pool.free([a[4], a[1]])
    pool.free([a[3]])
    assert free_order(pool) == [4, 1, 3]
    # allocation is least recently freed first
    assert ids(pool.allocate(2)) == [4, 1]
    pool.free([a[0], a[5]])
    assert free_order(pool) == [3, 0, 5]
    check_invariant(pool)


def test_a_free_cached_block_keeps_its_hash_until_it_is_reused():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"ha")
    pool.cache(b, b"hb")
    assert (a.block_hash, b.block_hash) == (b"ha", b"hb")
    assert pool.num_cached_free_blocks == 0  # cached but held
    pool.free([a, b])
    assert free_order(pool) == [2, 0, 1]
    assert pool.lookup(b"ha") is a and pool.lookup(b"hb") is b
    assert pool.num_cached_free_blocks == 2 and pool.num_free_blocks == 3
    # the never-used block 2 goes first: both cached blocks survive
    (c,) = pool.allocate(1)
    assert c.block_id == 2 and pool.lookup(b"ha") is a and pool.num_cached_free_blocks == 2
    # then the least recently freed cached block is evicted: hash cleared and forgotten
    (d,) = pool.allocate(1)
    assert d is a and a.block_hash is None and pool.lookup(b"ha") is None
    assert pool.lookup(b"hb") is b and pool.num_cached_free_blocks == 1
    assert b"ha" not in pool.cached
    check_invariant(pool)


def test_lookup_of_an_unknown_hash_is_none():
    pool = BlockPool(2)
    assert pool.lookup(b"never") is None
    (a,) = pool.allocate(1)
    pool.cache(a, b"x")
    assert pool.lookup(b"y") is None and pool.lookup(b"x") is a


def test_touch_reclaims_a_cached_free_block_and_refreeing_makes_it_most_recent():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]))
    pool.free(blocks)
    assert free_order(pool) == [0, 1, 2, 3]
    hit = pool.lookup(bytes([0]))
    pool.touch([hit])  # a prefix hit on the LRU block
    assert hit.ref_cnt == 1 and free_order(pool) == [1, 2, 3] and pool.num_cached_free_blocks == 3
    assert hit.block_hash == bytes([0])  # touch keeps the contents
    pool.free([hit])
    assert free_order(pool) == [1, 2, 3, 0]  # now the most recently used
    # evict two: the LRU ones (1, 2); 3 and 0 stay findable
    assert ids(pool.allocate(2)) == [1, 2]
    assert pool.lookup(bytes([1])) is None and pool.lookup(bytes([2])) is None
    assert pool.lookup(bytes([3])) is blocks[3] and pool.lookup(bytes([0])) is blocks[0]
    check_invariant(pool)


def test_touch_of_a_held_block_only_adds_a_reference():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h")
    pool.touch([b])
    assert b.ref_cnt == 2 and pool.num_free_blocks == 2 and free_order(pool) == [1, 2]


def test_touch_of_several_blocks_in_one_call():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]))
    pool.free(blocks[:2])  # blocks 0 and 1 free (cached), block 2 still held
    pool.touch(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 1, 2]
    assert free_order(pool) == [3]
    check_invariant(pool)


def test_cache_first_writer_wins():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"same")
    pool.cache(b, b"same")  # the same content computed twice: the duplicate stays uncached
    assert pool.lookup(b"same") is a
    assert a.block_hash == b"same" and b.block_hash is None
    pool.free([a, b])
    assert pool.num_cached_free_blocks == 1
    # evicting the first writer removes the entry; the duplicate had none to remove
    assert ids(pool.allocate(2)) == [2, 0]
    assert pool.lookup(b"same") is None and pool.cached == {}
    check_invariant(pool)


def test_cache_of_an_already_cached_block_keeps_its_first_hash():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, b"first")
    pool.cache(a, b"second")
    assert a.block_hash == b"first"
    assert pool.lookup(b"first") is a and pool.lookup(b"second") is None
    check_invariant(pool)


def test_a_reused_block_can_be_cached_under_a_new_hash():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.cache(a, b"old")
    pool.free([a])
    (again,) = pool.allocate(1)
    assert again is a and a.block_hash is None
    pool.cache(a, b"new")
    assert pool.lookup(b"new") is a and pool.lookup(b"old") is None


def test_caching_disabled_never_registers_hashes():
    pool = BlockPool(3, enable_caching=False)
    a, b = pool.allocate(2)
    pool.cache(a, b"h")
    assert a.block_hash is None and pool.lookup(b"h") is None and pool.cached == {}
    pool.free([a, b])
    assert pool.num_cached_free_blocks == 0 and pool.num_free_blocks == 3
    # the LRU order still holds without caching
    assert free_order(pool) == [2, 0, 1]


def test_reset_prefix_cache_forgets_every_hash_but_keeps_references_and_queue():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache(blk, h)
    pool.free([b])  # b free and cached; a and c held
    order_before = free_order(pool)
    pool.reset_prefix_cache()
    assert [x.block_hash for x in pool.blocks] == [None] * 4
    assert pool.cached == {} and pool.num_cached_free_blocks == 0
    assert all(pool.lookup(h) is None for h in (b"a", b"b", b"c"))
    assert [a.ref_cnt, b.ref_cnt, c.ref_cnt] == [1, 0, 1]
    assert free_order(pool) == order_before == [3, 1]
    assert pool.num_free_blocks == 2
    # a held block freed after the reset comes back uncached; blocks can be cached again
    pool.free([a])
    assert pool.num_cached_free_blocks == 0
    pool.cache(c, b"a")
    assert pool.lookup(b"a") is c
    check_invariant(pool)


def test_reset_of_an_empty_cache_is_harmless():
    pool = BlockPool(2)
    pool.reset_prefix_cache()
    assert pool.num_free_blocks == 2 and pool.cached == {} and free_order(pool) == [0, 1]


def test_random_operations_match_a_reference_model():
    """Random allocate / touch / free / cache sequences against a list-based model of the queue and the table."""
    rng = random.Random(1234)
    n = 12
    pool = BlockPool(n)
    ref_cnt = [0] * n
    queue = list(range(n))  # free block ids, LRU first
    table: dict[bytes, int] = {}  # hash -> block id
    hashes: list[bytes | None] = [None] * n
    holders: list[list[int]] = []  # each "request" holds a list of block ids
    for step in range(600):
        op = rng.choice(["alloc", "free", "free", "touch", "cache", "cache"]) if step % 97 else "reset"
        if op == "alloc":
            k = rng.randint(0, 4)
            if k > len(queue):
                with pytest.raises(ValueError):
                    pool.allocate(k)
                continue
            got = ids(pool.allocate(k))
            expect, queue = queue[:k], queue[k:]
            assert got == expect
            for i in expect:
                if hashes[i] is not None:
                    del table[hashes[i]]
                    hashes[i] = None
                ref_cnt[i] = 1
            holders.append(expect)
        elif op == "free" and holders:
            held = holders.pop(rng.randrange(len(holders)))
            pool.free(pool.blocks[i] for i in reversed(held))
            for i in reversed(held):
                ref_cnt[i] -= 1
                if ref_cnt[i] == 0:
                    queue.append(i)
        elif op == "touch" and table:
            i = table[rng.choice(sorted(table))]
            hit = pool.lookup(hashes[i])
            assert hit is pool.blocks[i]
            pool.touch([hit])
            if ref_cnt[i] == 0:
                queue.remove(i)
            ref_cnt[i] += 1
            holders.append([i])
        elif op == "cache" and any(holders):
            i = rng.choice(rng.choice([h for h in holders if h]))
            h = bytes([rng.randrange(6)])  # few distinct hashes: duplicates happen
            pool.cache(pool.blocks[i], h)
            if hashes[i] is None and h not in table:
                table[h] = i
                hashes[i] = h
        elif op == "reset":
            pool.reset_prefix_cache()
            table.clear()
            hashes = [None] * n
        assert free_order(pool) == queue
        assert [b.ref_cnt for b in pool.blocks] == ref_cnt
        assert [b.block_hash for b in pool.blocks] == hashes
        assert {h: b.block_id for h, b in pool.cached.items()} == table
        assert pool.num_cached_free_blocks == sum(hashes[i] is not None for i in queue)
        assert pool.usage == pytest.approx(1 - len(queue) / n)
        check_invariant(pool)


def test_double_free_raises_and_leaves_the_block_free_once():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    assert b.ref_cnt == 0 and free_order(pool).count(b.block_id) == 1
    check_invariant(pool)
