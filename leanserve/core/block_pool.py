"""The pool of KV cache blocks: reference counts, an LRU free queue, and the prefix-cache hash table.

A block whose reference count drops to 0 goes to the tail of the free queue but keeps its contents and its hash,
so a later request with the same prefix can take it back; new allocations take blocks from the head of the queue
(least recently used first) and only then evict their cached hash. Design after vLLM v1's ``BlockPool``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    """Metadata of one block of ``block_size`` token slots in every layer's KV cache."""

    block_id: int
    ref_cnt: int = 0  # requests holding the block
    block_hash: bytes | None = None  # set once the block is full and cached


class BlockPool:
    """Allocates, frees and caches blocks ``0 .. num_blocks - 1``.

    Invariant: every block with ``ref_cnt == 0`` is in the free queue (cached or not), and no other block is.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (including cached ones that may be evicted)."""
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        """The cached block with this hash, or None."""
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), removing free ones from the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes.

        Raises:
            ValueError: when fewer than ``n`` blocks are free (callers check :attr:`num_free_blocks` first).
        """
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, b = self.free_queue.popitem(last=False)
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the tail of the free queue in order.

        Raises:
            ValueError: a block that holds no reference (a double free); the pool is unchanged for it.
        """
        for b in blocks:
            if b.ref_cnt <= 0:
                raise ValueError(f"block {b.block_id} is already free (double free)")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under ``block_hash`` (first writer wins; a duplicate stays uncached)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks held by requests keep their contents)."""
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
