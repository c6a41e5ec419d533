"""The answer cache: finished answers of deterministic requests, kept in an LRU bounded in bytes with a TTL.

A key is a SHA-256 digest of everything that decides the output (:func:`cache_key`): the caller builds it from
the tenant, the served model, the endpoint, the full prompt token ids and every sampling parameter. Only
deterministic requests may be cached (:func:`is_deterministic`: greedy, or seeded). Values are opaque bytes (the
serving layer pickles the outputs it replays), so the size of an entry is exact: its payload, its 32-byte key
and :data:`ENTRY_OVERHEAD` bytes for the bookkeeping (dict slot, list node, timestamps). ``nbytes`` never
exceeds ``max_bytes``: inserting evicts least recently used entries first, and an entry larger than the whole
bound is not stored. An entry older than ``ttl`` seconds is a miss (and is removed; inserting also removes the
expired entries at the least recently used end). An entry may carry ``extra_nbytes`` charged with it (the
semantic index's embedding of its question), and ``on_remove(key)`` is called for every entry that leaves the
cache (evicted, expired, replaced, cleared), so whatever else holds that key is dropped with it. Thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from leanserve.errors import InvalidParameterError

ENTRY_OVERHEAD = 512  # bytes charged per entry besides payload and key: objects, dict and list slots (tested)
SAMPLING_EPS = 1e-5  # as SamplingParams: a temperature below it is greedy


def is_deterministic(temperature: float, seed: int | None) -> bool:
    """Whether a request's output is a function of its inputs: greedy (temperature < 1e-5) or seeded."""
    return temperature < SAMPLING_EPS or seed is not None


def cache_key(*parts: Any) -> bytes:
    """SHA-256 of the parts as canonical JSON (sorted keys; tuples as lists).

    Raises:
        TypeError: a part JSON cannot encode.
    """
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_default)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).digest()


def _default(obj: Any) -> Any:
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"cannot key {type(obj).__name__}")


@dataclass(frozen=True)
class CacheEntry:
    payload: bytes
    created: float
    extra_nbytes: int = 0  # charged with the entry (e.g. its question's semantic index entry)

    @property
    def nbytes(self) -> int:
        return len(self.payload) + 32 + ENTRY_OVERHEAD + self.extra_nbytes


class AnswerCache:
    """LRU of ``key (bytes) -> payload (bytes)`` within ``max_bytes``, entries valid ``ttl`` seconds.

    Raises:
        InvalidParameterError: ``max_bytes`` < 1 or ``ttl`` <= 0.
    """

    def __init__(self, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic,
                 on_remove: Callable[[bytes], Any] | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise InvalidParameterError("answer_cache_bytes", f"answer_cache_bytes must be >= 1, got {max_bytes!r}")
        if not ttl > 0:
            raise InvalidParameterError("answer_cache_ttl", f"answer_cache_ttl must be > 0, got {ttl!r}")
        self.max_bytes = max_bytes
        self.ttl = float(ttl)
        self._clock = clock
        self._on_remove = on_remove
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> bytes | None:
        """The payload under ``key``, or None (absent or expired); a hit becomes the most recently used."""
        with self._lock:
            self.queries += 1
            entry = self._entries.get(key)
            if entry is None:
                return None
            if self._clock() - entry.created > self.ttl:
                self._remove(key)
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry.payload

    def put(self, key: bytes, payload: bytes, extra_nbytes: int = 0) -> bool:
        """Store ``payload`` under ``key`` (replacing any), charged ``extra_nbytes`` more, evicting expired then
        least recently used entries to stay within ``max_bytes``. Returns False, storing nothing, when the entry
        alone exceeds the bound."""
        now = self._clock()
        entry = CacheEntry(bytes(payload), now, extra_nbytes)
        if entry.nbytes > self.max_bytes:
            return False
        with self._lock:
            if key in self._entries:
                self._remove(key)
            while self._entries:  # expired entries at the least recently used end
                head = next(iter(self._entries))
                if now - self._entries[head].created <= self.ttl:
                    break
                self._remove(head)
            while self._entries and self.nbytes + entry.nbytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self.evictions += 1
            self._entries[key] = entry
            self.nbytes += entry.nbytes
            return True

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        if self._on_remove is not None:
            self._on_remove(key)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._remove(key)
            self.nbytes = 0
