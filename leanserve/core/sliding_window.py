"""Blocks of the sliding-window (local) layers: a second, smaller pool mapped onto the main pool's block ids.

A model with sliding-window layers (Gemma 3: 15 of its 18 layers see the last 512 keys) keeps the main block
tables for its global layers; each main block that some request still needs for a local layer also gets a block
of the local pool, and the local layers read and write ``local_of[block_id]`` instead of ``block_id``. A request
needs, for its local layers, the blocks from the one holding position ``num_computed - window + 1`` on (plus
what it allocates for the step); the blocks before that are unpinned when it next allocates, and all of them
when it is freed, so a request pins at most ``cdiv(window, block_size) + 1`` blocks plus the step's new ones, and
the local pool's memory is bounded by the window and the batch, not the context.

Unpinned local blocks keep their contents (LRU, for prefix-cache hits) until a pin needs their room. A
prefix-cache hit is only usable up to a point where every block of its window still has its local block
(:meth:`SlidingWindowBlocks.usable_hit`). Design after vLLM's hybrid KV cache manager, where each KV cache group
(full attention, sliding window) has its own block table and the sliding-window manager frees blocks outside the
window; here the local "table" is derived from the main one through ``local_of``, so the scheduler, the runner's
block tables and the prefix cache's hashes are unchanged.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def local_pool_size(num_blocks: int, block_size: int, window: int, max_num_seqs: int,
                    max_num_batched_tokens: int) -> int:
    """Local blocks enough for every running request's window plus one step's new tokens, never more than the
    main pool: ``max_num_seqs * (cdiv(window, block_size) + 2) + cdiv(max_num_batched_tokens, block_size)``."""
    need = max_num_seqs * (_cdiv(window, block_size) + 2) + _cdiv(max_num_batched_tokens, block_size)
    return min(num_blocks, need)


class SlidingWindowBlocks:
    """The local pool: ``local_of[block_id]`` (-1: none) and the pins that keep it.

    Args:
        num_blocks: blocks of the main pool (the ids ``local_of`` is indexed by).
        num_local_blocks: blocks of the local layers' caches.
        block_size: tokens per block.
        window: keys a local layer's query sees, itself included.

    Attributes:
        local_of: ``array('q')`` of ``num_blocks`` local ids (-1: none); the runner reads it in place each step.
    """

    def __init__(self, num_blocks: int, num_local_blocks: int, block_size: int, window: int) -> None:
        if num_local_blocks < 1 or window < 1:
            raise ValueError(f"need at least one local block and a window, got {num_local_blocks}, {window}")
        self.block_size = block_size
        self.window = window
        self.num_local_blocks = num_local_blocks
        self.local_of = array("q", [-1]) * num_blocks
        self._free = list(range(num_local_blocks - 1, -1, -1))  # local ids never used or released
        self._pins = [0] * num_blocks  # requests pinning each main block
        self._idle: OrderedDict[int, None] = OrderedDict()  # main blocks with a local block and no pin, LRU first
        self._pinned: dict[str, list[int]] = {}  # request -> main blocks it pins, in position order
        self._first: dict[str, int] = {}  # request -> index in its block table of its first pinned block

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def num_pinned(self) -> int:
        """Local blocks pinned by requests (the rest are idle cached ones or free)."""
        return self.num_local_blocks - len(self._free) - len(self._idle)

    def pinned_blocks(self, request_id: str) -> int:
        """Local blocks the request pins."""
        return len(self._pinned.get(request_id, ()))

    def first_needed(self, num_computed: int) -> int:
        """Index of the first block a request with ``num_computed`` tokens computed still needs for local layers."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def usable_hit(self, block_ids: list[int]) -> int:
        """How many leading blocks of a prefix-cache hit are usable: the most ``h`` such that every block the
        request then needs (from :meth:`first_needed` of ``h * block_size`` to ``h - 1``) has its local block."""
        for h in range(len(block_ids), 0, -1):
            if all(self.local_of[b] >= 0 for b in block_ids[self.first_needed(h * self.block_size):h]):
                return h
        return 0

    def can_pin(self, request_id: str, table_len: int, num_computed: int) -> bool:
        """Whether :meth:`pin` of a table of ``table_len`` blocks at ``num_computed`` finds a local block for every
        block it newly pins (counting free and idle local blocks only: a conservative answer)."""
        pinned = len(self._pinned.get(request_id, ()))
        first = self._first.get(request_id, 0)
        start = max(first, self.first_needed(num_computed))
        new = table_len - start - max(0, pinned - (start - first))
        return new <= len(self._free) + len(self._idle)

    # ------------------------------------------------------------------------------------------------ updates
    def pin(self, request_id: str, table: list[int], num_computed: int) -> None:
        """Bring the request's pins to its table from :meth:`first_needed` of ``num_computed`` on: unpin the
        blocks before it, pin (and give a local block to) the new ones at the end of ``table``.

        Raises:
            RuntimeError: no local block left (callers check :meth:`can_pin` first).
        """
        pinned = self._pinned.setdefault(request_id, [])
        first = self._first.get(request_id, 0)
        start = max(first, self.first_needed(num_computed))
        for b in pinned[: start - first]:
            self._unpin(b)
        del pinned[: start - first]
        self._first[request_id] = start
        for b in table[start + len(pinned):]:
            self._pin(b)
            pinned.append(b)

    def release(self, request_id: str) -> None:
        """Unpin every block of the request (finished, aborted or preempted); their local blocks become idle."""
        for b in self._pinned.pop(request_id, ()):
            self._unpin(b)
        self._first.pop(request_id, None)

    def _pin(self, b: int) -> None:
        if self._pins[b] == 0:
            if self.local_of[b] >= 0:
                del self._idle[b]
            else:
                self.local_of[b] = self._take()
        self._pins[b] += 1

    def _unpin(self, b: int) -> None:
        self._pins[b] -= 1
        if self._pins[b] == 0:
            self._idle[b] = None

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        if not self._idle:
            raise RuntimeError("no local KV block left (check can_pin first)")
        victim, _ = self._idle.popitem(last=False)
        local = self.local_of[victim]
        self.local_of[victim] = -1
        return local


def sliding_window_block_counts(plain_blocks: int, kv_bytes: int, block_size: int, bytes_per_token: int,
                                sliding_layers: int, num_layers: int, local_need: int) -> tuple[int, int]:
    """(main pool blocks, local pool blocks) for ``kv_bytes`` of KV cache when ``sliding_layers`` of the
    ``num_layers`` (equal-sized) layers keep only ``local_need`` blocks (:func:`local_pool_size` before its cap):
    the local pool's bytes come off the budget and the rest holds main blocks of the global layers only. Falls
    back to ``(plain_blocks, plain_blocks)`` (every layer the same pool) when that would hold no more blocks."""
    local_bytes = local_need * block_size * bytes_per_token * sliding_layers // num_layers
    global_per_block = block_size * bytes_per_token * (num_layers - sliding_layers) // num_layers
    if global_per_block <= 0 or kv_bytes <= local_bytes:
        return plain_blocks, plain_blocks
    main = (kv_bytes - local_bytes) // global_per_block
    if main <= plain_blocks or main < local_need:
        return plain_blocks, min(plain_blocks, local_need)
    return int(main), local_need
