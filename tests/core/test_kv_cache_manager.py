"""Block pool and KV cache manager: ref counts, LRU eviction, prefix hits (no model needed)."""

from leanserve.core.block_pool import BlockPool
from leanserve.core.kv_cache_manager import KVCacheManager, hash_block
from leanserve.core.request import Request
from leanserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens)


def test_pool_refcounts_and_lru_order():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.ref_cnt for b in a] == [1, 1] and pool.num_free_blocks == 2
    pool.cache(a[0], b"h0")
    pool.free(reversed(a))  # tail first: a[1] is evicted before a[0]
    assert pool.num_free_blocks == 4
    assert pool.lookup(b"h0") is a[0]
    taken = pool.allocate(3)  # blocks 2, 3 (never used) then a[1]
    assert [b.block_id for b in taken] == [2, 3, a[1].block_id]
    assert pool.lookup(b"h0") is a[0]  # still cached
    pool.allocate(1)  # now a[0] is evicted
    assert pool.lookup(b"h0") is None and a[0].block_hash is None


def test_touch_takes_cached_free_block_back():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache(b, b"x")
    pool.free([b])
    assert pool.num_free_blocks == 2
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([b])
    assert b.ref_cnt == 2 and pool.num_free_blocks == 1


def test_hash_is_chained_over_parent():
    assert hash_block(b"", [1, 2]) != hash_block(b"a", [1, 2])
    assert hash_block(b"", [1, 2]) == hash_block(b"", [1, 2])
    assert hash_block(b"", [1, 2]) != hash_block(b"", [2, 1])


def test_prefix_hit_reuses_full_blocks_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r1 = make_request("a", list(range(12)))  # exactly 3 blocks
    assert kv.get_computed_blocks(r1) == ([], 0)
    assert kv.allocate_slots(r1, 12)
    first_two = kv.block_ids("a")[:2]
    r1.num_computed_tokens = 12
    kv.cache_blocks(r1)
    kv.free(r1)
    # same prompt: at most (12 - 1) // 4 = 2 blocks reused, the last token recomputed
    r2 = make_request("b", list(range(12)))
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8 and [b.block_id for b in hits] == first_two  # the blocks request "a" filled
    assert kv.allocate_slots(r2, 4, hits)
    assert kv.block_ids("b")[:2] == [b.block_id for b in hits]
    # a prompt sharing only the first block
    r3 = make_request("c", list(range(4)) + [99] * 8)
    hits3, n3 = kv.get_computed_blocks(r3)
    assert n3 == 4 and hits3[0] is hits[0]
    # leaving at least 5 tokens to compute: one block fewer
    kv.min_uncached_tokens = 5
    assert kv.get_computed_blocks(r2)[1] == 4


def test_allocate_fails_without_side_effects_and_free_restores():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = make_request("a", list(range(20)))
    assert not kv.allocate_slots(r, 20)  # needs 5 blocks
    assert kv.pool.num_free_blocks == 3 and kv.block_ids("a") == []
    assert kv.allocate_slots(r, 8)
    assert kv.pool.num_free_blocks == 1
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1)  # a third block for token 9
    assert kv.pool.num_free_blocks == 0
    kv.free(r)
    assert kv.pool.num_free_blocks == 3


def test_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    r = make_request("a", list(range(9)))
    kv.allocate_slots(r, 9)
    r.num_computed_tokens = 9
    kv.cache_blocks(r)
    kv.free(r)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
