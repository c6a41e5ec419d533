"""The sliding-window layers' block pool (leanserve.core.sliding_window): pins bounded by the window, idle blocks
kept for prefix hits and evicted LRU, prefix hits cut to where their window is still held, nothing leaked; and
through KVCacheManager, the same bookkeeping as the scheduler drives it."""

from __future__ import annotations

from leanserve.core.kv_cache_manager import KVCacheManager
from leanserve.core.request import Request
from leanserve.core.sliding_window import SlidingWindowBlocks, local_pool_size, sliding_window_block_counts
from leanserve.sampling_params import SamplingParams

import pytest

BS, W = 4, 8  # window of 8 keys = 2 blocks; a request needs at most cdiv(W, BS) + 1 old blocks + its new ones


def test_pins_follow_the_window():
    swa = SlidingWindowBlocks(num_blocks=32, num_local_blocks=8, block_size=BS, window=W)
    table = []
    for computed in range(0, 40, 4):  # one block of new tokens per step
        table.append(len(table))
        swa.pin("r", table, computed)
        first = max(0, computed - W + 1) // BS
        assert swa.pinned_blocks("r") == len(table) - first <= W // BS + 2
        assert all(swa.local_of[b] >= 0 for b in table[first:])
    assert swa.num_pinned == swa.pinned_blocks("r")
    swa.release("r")
    assert swa.num_pinned == 0 and swa.pinned_blocks("r") == 0


def test_idle_blocks_are_evicted_lru_and_hits_are_cut():
    swa = SlidingWindowBlocks(num_blocks=32, num_local_blocks=4, block_size=BS, window=W)
    swa.pin("a", [0, 1, 2], 8)  # positions 8..11 need keys from 1 on: blocks 0..2 pinned (0 from the start)
    swa.release("a")
    assert swa.usable_hit([0, 1, 2]) == 3  # all still held (idle)
    swa.pin("b", [10, 11], 0)  # 4 local blocks: one free, then the LRU idle one (block 0) is evicted
    assert swa.local_of[0] == -1 and swa.local_of[1] >= 0
    # a hit of blocks 0..2 (12 tokens) needs blocks from (12 - 8 + 1) // 4 = 1 on: still usable
    assert swa.usable_hit([0, 1, 2]) == 3
    swa.pin("c", [12], 0)  # evicts block 1
    assert swa.usable_hit([0, 1, 2]) == 0  # h=3 needs 1, h=2 needs 0..1, h=1 needs 0: none held
    assert not swa.can_pin("d", 3, 0)  # 1 idle block left (2), 3 needed
    with pytest.raises(RuntimeError):
        swa.pin("d", [20, 21, 22], 0)


def test_pool_sizes():
    assert local_pool_size(10_000, 16, 512, 64, 2048) == 64 * 34 + 128
    assert local_pool_size(100, 16, 512, 64, 2048) == 100
    # Gemma 3 270M: 15 of 18 layers local, 36864 B/token in all layers, 2 GiB -> 3640 plain blocks
    main, local = sliding_window_block_counts(3640, 2 << 30, 16, 36864, 15, 18, 2304)
    assert local == 2304 and main * 16 * 36864 * 3 // 18 + local * 16 * 36864 * 15 // 18 <= 2 << 30
    assert main > 3640 * 2  # the same memory holds over twice the context
    assert sliding_window_block_counts(100, 100 * 16 * 36864, 16, 36864, 15, 18, 2304) == (100, 100)


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1000, 1000 + n)), SamplingParams(max_tokens=4), 4)


def test_kv_cache_manager_pins_frees_and_cuts_hits():
    swa = SlidingWindowBlocks(num_blocks=64, num_local_blocks=10, block_size=BS, window=W)
    kv = KVCacheManager(64, BS, enable_caching=True, sliding_window=swa)
    r = _req("r", 40)
    for chunk in (8, 8, 8, 8, 7):  # chunked prefill: 5 steps
        assert kv.allocate_slots(r, chunk)
        assert swa.pinned_blocks("r") <= W // BS + 2 + chunk // BS
        r.num_computed_tokens += chunk
        kv.cache_blocks(r)
    assert len(kv.block_ids("r")) == 10 and swa.pinned_blocks("r") < 10
    kv.free(r)
    assert swa.num_pinned == 0 and kv.pool.num_free_blocks == 64
    # same prompt again: the hit is cut to where the window's local blocks are still held
    r2 = _req("r2", 40)
    hits, n = kv.get_computed_blocks(r2)
    assert n == len(hits) * BS and 0 < n <= 36
    first = max(0, n - W + 1) // BS
    assert all(swa.local_of[b.block_id] >= 0 for b in hits[first:])
    assert kv.allocate_slots(r2, 40 - n, hits)
    kv.free(r2)
    assert swa.num_pinned == 0 and kv.pool.num_free_blocks == 64
