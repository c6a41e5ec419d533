"""Replica routing policies: plain Python over the router's own view of each replica (no Ray, no I/O).

Each policy picks one replica for a request from :class:`ReplicaState` (healthy or not, requests in flight, an
approximate index of the prompt prefixes routed there). The caller counts load with :meth:`Router.acquire`, which
returns a :class:`LoadTicket` to release exactly once when the request ends, whatever the path (streamed or not,
finished, aborted by the client, failed): a path that never released would make one replica look busy forever and
send every request to the others.

Policies (``--replica-router``):

- ``cache_aware``: after SGLang's cache-aware router (sgl-router ``cache_aware`` policy). The system is *imbalanced*
  when ``max_load - min_load > balance_abs_threshold`` **and** ``max_load > balance_rel_threshold * min_load``
  (loads = requests in flight); then the least-loaded replica takes the request. Otherwise the replica whose
  index holds the longest prefix of the prompt takes it if the matched fraction exceeds ``cache_threshold``;
  below it, the replica with the smallest index (the most room for a new prefix) does. Ties go to the less
  loaded replica, then to the lower index.
- ``round_robin``: the healthy replicas in turn.
- ``power_of_two``: two distinct healthy replicas drawn at random (seeded), the less loaded one wins.

The prefix index stores chained block hashes, the engines' scheme (``core/kv_cache_manager.hash_block``: a block's
hash covers its parent's, so equal hashes mean equal whole prefixes): over token ids in blocks of ``block_size``
tokens (:func:`token_block_hashes`), or, when the router has no tokenizer, over the prompt's UTF-8 bytes in blocks
of ``block_bytes`` (:func:`text_block_hashes`). It is approximate in SGLang's sense: it records what was *routed*,
not what each engine still caches; an LRU bound (``max_blocks_per_replica``) stands in for the engine's eviction.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from leanserve.config import REPLICA_ROUTERS
from leanserve.core.kv_cache_manager import hash_block
from leanserve.errors import InvalidParameterError


class NoReplicaAvailable(Exception):
    """Every replica is unhealthy or excluded (already tried) for this request."""


def token_block_hashes(token_ids: Sequence[int], block_size: int = 16) -> list[bytes]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids``, as the engines' prefix cache
    computes them (a trailing partial block has none)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, list(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


def text_block_hashes(text: str, block_bytes: int = 64) -> list[bytes]:
    """Chained BLAKE2b-128 hashes of ``text``'s UTF-8 bytes in blocks of ``block_bytes`` (the last, partial block
    included, so a short prompt still has a key). Equal leading hashes mean equal leading text."""
    data = text.encode("utf-8", "surrogatepass")
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(data), block_bytes):
        parent = hashlib.blake2b(parent + data[start:start + block_bytes], digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """The block hashes routed to one replica, least recently routed evicted first past ``max_blocks``."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` the index holds (the longest routed prefix, in blocks)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Iterable[bytes]) -> None:
        """Record (or refresh) ``hashes``, then evict the least recently routed blocks past ``max_blocks``."""
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass
class ReplicaState:
    """The router's view of one replica."""

    name: str
    max_blocks: int = 1 << 16
    healthy: bool = True
    in_flight: int = 0  # requests routed here and not yet released
    routed: int = 0  # requests routed here in all
    index: PrefixIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = PrefixIndex(self.max_blocks)


class LoadTicket:
    """One request's share of a replica's load; :meth:`release` is idempotent (every exit path may call it)."""

    def __init__(self, router: Router, replica: str) -> None:
        self._router = router
        self.replica = replica
        self.released = False

    def release(self) -> None:
        with self._router._lock:
            if self.released:
                return
            self.released = True
            self._router.replicas[self.replica].in_flight -= 1

    def __enter__(self) -> LoadTicket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Router:
    """Base of the policies: the replica states, health marks and load tickets. Thread-safe.

    Args:
        names: the replicas, in order (ties go to the earlier one).
        max_blocks_per_replica: bound of each replica's prefix index, in blocks.
    """

    policy = "base"

    def __init__(self, names: Sequence[str], max_blocks_per_replica: int = 1 << 16) -> None:
        if not names:
            raise InvalidParameterError("replicas", "a router needs at least one replica")
        if len(set(names)) != len(names):
            raise InvalidParameterError("replicas", f"replica names must be distinct, got {list(names)}")
        self.replicas: dict[str, ReplicaState] = {n: ReplicaState(n, max_blocks_per_replica) for n in names}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ state
    def set_healthy(self, name: str, healthy: bool) -> None:
        """Take a replica out of routing (False) or back in (True). A replica coming back has lost its cache (it
        was restarted): its prefix index is cleared."""
        with self._lock:
            state = self.replicas[name]
            if healthy and not state.healthy:
                state.index.clear()
            state.healthy = healthy

    def healthy_names(self) -> list[str]:
        return [n for n, s in self.replicas.items() if s.healthy]

    def acquire(self, name: str) -> LoadTicket:
        """Count one request in flight on ``name`` until the returned ticket is released."""
        with self._lock:
            state = self.replicas[name]
            state.in_flight += 1
            state.routed += 1
        return LoadTicket(self, name)

    # ------------------------------------------------------------------------------------------ routing
    def choose(self, hashes: Sequence[bytes] = (), exclude: Iterable[str] = ()) -> str:
        """The replica for a request whose prompt has the chained block ``hashes`` (empty: no key), among the
        healthy replicas not in ``exclude``; records the prefix on the chosen replica.

        Raises:
            NoReplicaAvailable: no healthy replica is left.
        """
        excluded = set(exclude)
        with self._lock:
            candidates = [s for s in self.replicas.values() if s.healthy and s.name not in excluded]
            if not candidates:
                raise NoReplicaAvailable("no healthy replica is available")
            chosen = self._pick(candidates, list(hashes))
            if hashes:
                chosen.index.insert(hashes)
            return chosen.name

    def _pick(self, candidates: list[ReplicaState], hashes: list[bytes]) -> ReplicaState:
        raise NotImplementedError


class CacheAwareRouter(Router):
    """SGLang's cache-aware policy (see the module docstring). Defaults are sgl-router's."""

    policy = "cache_aware"

    def __init__(self, names: Sequence[str], max_blocks_per_replica: int = 1 << 16, *, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.0001) -> None:
        super().__init__(names, max_blocks_per_replica)
        if not 0.0 <= cache_threshold <= 1.0:
            raise InvalidParameterError("cache_threshold", f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise InvalidParameterError("balance_abs_threshold",
                                        "balance thresholds must be abs >= 0 and rel >= 1")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.decisions = {"balance": 0, "affinity": 0, "capacity": 0}  # why each request went where it went

    def imbalanced(self, loads: Sequence[int]) -> bool:
        """SGLang's test: ``max - min > abs`` and ``max > rel * min``."""
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def _pick(self, candidates: list[ReplicaState], hashes: list[bytes]) -> ReplicaState:
        if self.imbalanced([s.in_flight for s in candidates]) or not hashes:
            self.decisions["balance"] += 1
            return min(candidates, key=lambda s: s.in_flight)  # min keeps the first of equals
        matches = [s.index.match(hashes) for s in candidates]
        best = max(range(len(candidates)), key=lambda i: (matches[i], -candidates[i].in_flight))
        if matches[best] / len(hashes) > self.cache_threshold:
            self.decisions["affinity"] += 1
            return candidates[best]
        self.decisions["capacity"] += 1
        return min(candidates, key=lambda s: (len(s.index), s.in_flight))


class RoundRobinRouter(Router):
    policy = "round_robin"

    def __init__(self, names: Sequence[str], max_blocks_per_replica: int = 1 << 16) -> None:
        super().__init__(names, max_blocks_per_replica)
        self._next = 0
        self._order = list(names)

    def _pick(self, candidates: list[ReplicaState], hashes: list[bytes]) -> ReplicaState:
        names = {s.name: s for s in candidates}
        for k in range(len(self._order)):
            name = self._order[(self._next + k) % len(self._order)]
            if name in names:
                self._next = (self._order.index(name) + 1) % len(self._order)
                return names[name]
        raise AssertionError("unreachable: candidates is not empty")


class PowerOfTwoRouter(Router):
    policy = "power_of_two"

    def __init__(self, names: Sequence[str], max_blocks_per_replica: int = 1 << 16, *, seed: int = 0) -> None:
        super().__init__(names, max_blocks_per_replica)
        self._rng = random.Random(seed)

    def _pick(self, candidates: list[ReplicaState], hashes: list[bytes]) -> ReplicaState:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if a.in_flight <= b.in_flight else b


def make_router(policy: str, names: Sequence[str], **kwargs) -> Router:
    """The router of ``--replica-router`` ``policy``.

    Raises:
        InvalidParameterError: an unknown policy.
    """
    classes = {"cache_aware": CacheAwareRouter, "round_robin": RoundRobinRouter, "power_of_two": PowerOfTwoRouter}
    if policy not in classes:
        raise InvalidParameterError("replica_router",
                                    f"unknown replica router {policy!r}; choose one of {', '.join(REPLICA_ROUTERS)}")
    return classes[policy](names, **kwargs)
