"""Per-request block tables over the :class:`BlockPool`, with prefix caching.

A full block is identified by a hash chained over its parent block's hash and its own token ids, so equal hashes
mean equal whole prefixes. Hashes are BLAKE2b (128-bit) digests: collisions would silently corrupt outputs, so
Python's 64-bit ``hash`` is not used.
"""

from __future__ import annotations

import hashlib
from array import array

from leanserve.core.block_pool import BlockPool, KVCacheBlock
from leanserve.core.request import Request
from leanserve.core.sliding_window import SlidingWindowBlocks


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: BLAKE2b-128 over the parent hash and the tokens as int64."""
    return hashlib.blake2b(parent_hash + array("q", token_ids).tobytes(), digest_size=16).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees the blocks of each request; finds and records cached prefixes.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_caching: turn prefix caching on.
        min_uncached_tokens: a prefix hit leaves at least this many of a request's tokens to compute (at least
            the last one, whose logits are needed; the engine asks for a few more so that the recomputed tail runs
            through the same kernels as a cold prefill and gives bitwise the same result).
        sliding_window: the local layers' pool of a model with sliding-window layers, or None (see
            :mod:`leanserve.core.sliding_window`): allocation also pins local blocks, prefix hits are cut to where
            their window's local blocks remain.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 min_uncached_tokens: int = 1, sliding_window: SlidingWindowBlocks | None = None) -> None:
        self.sliding_window = sliding_window
        self.min_uncached_tokens = max(1, min_uncached_tokens)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already in the hash table
        self.prefix_cache_queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.prefix_cache_hits = 0  # of which served from the cache (vllm:prefix_cache_hits)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vllm:kv_cache_usage_perc)."""
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (block ids in sequence order)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, request.token_at(i * bs, (i + 1) * bs)))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks, leaving at least ``min_uncached_tokens`` of its
        tokens (always the last one) to compute. None for a request that asks for prompt logprobs (as vLLM): every
        prompt position must run through the model, so its logprobs do not depend on what the cache held.

        Returns:
            (blocks, num_tokens): the cached blocks and the number of tokens they cover.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = max(0, request.num_tokens - self.min_uncached_tokens) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in self._block_hashes(request, max_blocks):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        if self.sliding_window is not None and hits:
            del hits[self.sliding_window.usable_hit([b.block_id for b in hits]):]
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup in the prefix-cache query/hit counters (tokens)."""
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed (and newly hit) ones.

        Returns:
            False, changing nothing, when the pool lacks free blocks; True once the blocks are held.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)  # hits sitting in the free queue
        swa = self.sliding_window
        if need > self.pool.num_free_blocks - reclaimed or (swa is not None and not swa.can_pin(
                request.request_id, len(blocks) + len(new_computed_blocks) + max(need, 0), num_computed)):
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        if swa is not None:
            swa.pin(request.request_id, [b.block_id for b in blocks], num_computed)
        if new_computed_blocks:
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        return True

    def cache_blocks(self, request: Request) -> None:
        """Record the request's full, computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        blocks = self.req_to_blocks[request.request_id]
        hashes = self._block_hashes(request, num_full)
        for i in range(done, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first (so its unshared tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if self.sliding_window is not None:
            self.sliding_window.release(request.request_id)
        self.pool.free(reversed(blocks))

    def num_tokens_capacity(self) -> int:
        """Tokens the whole pool can hold."""
        return self.pool.num_blocks * self.block_size
