"""The KV pools' own anonymous mappings (leanserve/quantization/anon_memory.py, kv_cache.zeroed): zero, 2 MiB
aligned, lazily mapped (no resident memory until written), huge pages where the kernel gives them, unmapped when
the last tensor of the pool is freed; the int8 cache's pools alike; prefault (--kv-cache-prefault) makes a pool
resident with its contents unchanged."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.quantization.anon_memory import HUGE_PAGE, anonymous_zeros, prefault
from leanserve.quantization.kv_cache import Int8KVCache, prefault_pool, zeroed

import pytest
import torch

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _mapping(address: int) -> dict[str, int] | None:
    """The /proc/self/smaps fields (kB) of the mapping holding ``address``, or None when none does."""
    found, fields = False, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            if found:
                break
            start, end = (int(x, 16) for x in head.split("-"))
            found = start <= address < end
        elif found and line.endswith(" kB"):
            name, value = line.split(":")
            fields[name] = int(value.split()[0])
    return fields if found else None


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_zero_aligned_and_contiguous(dtype) -> None:
    t = zeroed((37, 16, 3, 64), dtype)
    assert t.shape == (37, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t[5, 3] = 2  # writable
    assert t.float().sum().item() == 2 * 3 * 64
    assert anonymous_zeros((0, 4), dtype).shape == (0, 4)
    with pytest.raises(ValueError):
        anonymous_zeros((-1, 4), dtype)


@linux
def test_lazily_mapped_huge_pages_and_released_when_dropped() -> None:
    pool = zeroed((2048, 16, 3, 64), torch.float32)  # 24 MiB
    address = pool.data_ptr()
    assert _mapping(address)["Rss"] == 0  # nothing resident before the first write
    pool[:1024].fill_(1.0)  # the first 12 MiB
    touched = _mapping(address)
    assert 12 * 1024 <= touched["Rss"] <= 14 * 1024
    if _thp_mode() in ("always", "madvise"):
        assert touched["AnonHugePages"] >= 8 * 1024  # most of it in 2 MiB pages (some may be split under pressure)
    view = pool[10:20]
    del pool
    gc.collect()
    assert _mapping(address) is not None  # a view keeps the mapping
    del view
    gc.collect()
    assert _mapping(address) is None  # unmapped with the last tensor


@linux
def test_int8_cache_pools_are_mappings_released_with_the_cache() -> None:
    cache = Int8KVCache.zeros(512, 16, 3, 64)
    addresses = [cache.data.data_ptr(), cache.scale.data_ptr()]
    assert all(a % HUGE_PAGE == 0 for a in addresses)
    assert all(_mapping(a) is not None for a in addresses)
    assert not cache.data.any() and not cache.scale.any()
    del cache
    gc.collect()
    assert all(_mapping(a) is None for a in addresses)


@linux
def test_prefault_makes_a_pool_resident_and_keeps_its_contents() -> None:
    pool = zeroed((1024, 16, 3, 64), torch.float16)  # 6 MiB
    address = pool.data_ptr()
    pool[100, 3] = 1.5
    before = _mapping(address)["Rss"]
    assert before <= 2 * 1024  # one page (a huge page at most) written so far
    prefault(pool)
    assert _mapping(address)["Rss"] >= 6 * 1024  # every page now resident
    assert pool[100, 3].eq(1.5).all() and pool.float().sum().item() == 1.5 * 3 * 64  # contents as they were
    odd = torch.arange(5000, dtype=torch.int16)[1:]  # not page aligned, not a whole number of pages
    prefault(odd)
    assert torch.equal(odd, torch.arange(1, 5000, dtype=torch.int16))
    prefault(torch.empty(0))  # nothing to do
    with pytest.raises(ValueError):
        prefault(torch.zeros(64, 64).t())


@linux
def test_prefault_pool_covers_every_layer_of_each_cache_type() -> None:
    fp = [(zeroed((256, 16, 3, 64), torch.float32), zeroed((256, 16, 3, 64), torch.float32)) for _ in range(2)]
    q8 = [(Int8KVCache.zeros(256, 16, 3, 64), Int8KVCache.zeros(256, 16, 3, 64))]
    assert prefault_pool(fp) == 4 * 256 * 16 * 3 * 64 * 4
    assert all(_mapping(t.data_ptr())["Rss"] >= 3 * 1024 for pair in fp for t in pair)
    assert prefault_pool(q8) == 2 * (256 * 16 * 3 * 64 + 256 * 16 * 3 * 4)
    assert all(_mapping(c.scale.data_ptr())["Rss"] >= 48 for c in q8[0])
