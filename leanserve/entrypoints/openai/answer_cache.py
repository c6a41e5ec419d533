"""The server's answer cache (``--answer-cache exact``): in front of the engine queue, per tenant.

A deterministic request (:func:`leanserve.context.answer_cache.is_deterministic`) whose ``cache`` field is not
false is looked up after the admission check (a pure validation: invalid requests stay 400s) and before the
engine queue. The key (:func:`leanserve.context.answer_cache.cache_key`) is: the tenant (API key owner; one
namespace without keys), the served model, the endpoint, the full prompt token ids as admitted (template,
policies and truncation applied), the resolved ``max_tokens`` and every field of ``SamplingParams`` but
``speculative`` (which does not change the output). A miss runs normally and its outputs are recorded step by
step; when it finishes with no choice aborted, its final outputs and the step boundaries are stored. A hit
replays the same snapshots without the engine, so a replayed stream has the live one's chunk structure, finish
reasons and usage, whichever of stream / non-stream filled the entry. A request whose identical twin is running
(not yet cached) waits for it and replays its answer (request coalescing: a burst of one question runs once);
if the twin ends without an answer (aborted, failed), the waiting request runs itself. Responses carry
``x-leanserve-cache: hit|miss`` and ``usage.leanserve.cache``; ``leanserve:answer_cache_queries_total`` and
``leanserve:answer_cache_hits_total{kind}`` count lookups and hits.

The semantic cache (``--answer-cache semantic``) adds, for a chat request whose exact key missed: the answer of
an earlier question asked in the same context (same tenant, model, messages but the last user message, policy
fields and parameters) whose embedding is at least ``--answer-cache-similarity`` similar and whose lexical guard
(numbers, negations, named entities, question words, persons, tense, prepositions' objects, content words in
order) is the same (:mod:`leanserve.context.semantic`). The index of cached questions is
part of the cache: each question's embedding and signature are charged to its answer's bytes
(``--answer-cache-bytes``) and leave with it (LRU, TTL); a lookup is one matrix-vector product over the questions
of that context with the same guard signature, so it stays fast (it runs on the event loop) as the index fills.
Its hits count as ``kind="semantic"``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from leanserve import metric_names as names
from leanserve.context.answer_cache import AnswerCache, cache_key, is_deterministic
from leanserve.context.semantic import (
    DEFAULT_THRESHOLD,
    SemanticIndex,
    WordLlamaEmbedder,
    guardable,
    query_signature,
)
from leanserve.engine.admission import AdmittedRequest
from leanserve.entrypoints.openai.tenants import TENANT_KEY
from leanserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Gauge

CACHE_HEADER = "x-leanserve-cache"


class ServingAnswerCache:
    """The answer cache of one served model, with its metrics in ``registry``."""

    def __init__(self, model_name: str, max_bytes: int, ttl: float, registry: CollectorRegistry | None = None,
                 semantic: bool = False, threshold: float | None = DEFAULT_THRESHOLD) -> None:
        self.model_name = model_name
        self.threshold = DEFAULT_THRESHOLD if threshold is None else threshold  # None: --answer-cache-similarity unset
        self.embedder = WordLlamaEmbedder() if semantic else None
        self.index = SemanticIndex() if semantic else None
        # an answer's semantic index entry is charged to its bytes and leaves with it (LRU, TTL)
        self.cache = AnswerCache(max_bytes, ttl, on_remove=self.index.discard if self.index is not None else None)
        self._pending: dict[bytes, asyncio.Future] = {}  # keys being answered now -> their record (or None)
        self.queries, self.hits, size, entries = _counters(registry)
        size.labels(model_name).set_function(lambda: self.cache.nbytes)
        entries.labels(model_name).set_function(lambda: len(self.cache))
        self.queries.labels(model_name)
        for k in ("exact", "semantic"):
            self.hits.labels(model_name, k)

    def key(self, raw_request: Request, endpoint: str, admitted: AdmittedRequest) -> bytes:
        tenant = raw_request.scope.get(TENANT_KEY)
        return cache_key(getattr(tenant, "name", None), self.model_name, endpoint, admitted.prompt_token_ids,
                         admitted.max_tokens, _params(admitted))

    def lookup(self, key: bytes, arrival: float, admitted: AdmittedRequest,
               semantic: SemanticQuery | None = None) -> CachedStream | None:
        """The cached answer under ``key``, else (semantic cache) the answer of a similar question in the same
        context; counts the lookup and the hit in the metrics."""
        self.queries.labels(self.model_name).inc()
        payload, kind = self.cache.get(key), "exact"
        if payload is None and semantic is not None and self.index is not None:
            found = self.index.match(semantic.context_key, semantic.vector, semantic.signature, self.threshold)
            if found is not None:
                payload, kind = self.cache.get(found[0]), "semantic"
                if payload is None:
                    self.index.discard(found[0])
        if payload is None:
            return None
        self.hits.labels(self.model_name, kind).inc()
        return CachedStream(pickle.loads(payload), admitted.prompt_token_ids, arrival)

    def semantic_query(self, raw_request: Request, endpoint: str, admitted: AdmittedRequest, query: str,
                       context: Any) -> SemanticQuery | None:
        """The semantic cache's view of a request: its question embedded, and the key of everything else
        (``context``: the messages but the question, the policies' fields; plus tenant, model, parameters)."""
        if self.embedder is None or not guardable(query):  # a script the guard cannot read: exact cache only
            return None
        tenant = raw_request.scope.get(TENANT_KEY)
        context_key = cache_key(getattr(tenant, "name", None), self.model_name, endpoint, context,
                                admitted.params.max_tokens, _params(admitted))
        return SemanticQuery(context_key, self.embedder.embed([query])[0], query_signature(query))

    def claim(self, key: bytes) -> asyncio.Future | None:
        """Mark ``key`` as being answered now (before the request is queued, so that identical requests arriving
        meanwhile wait for it); None when another request already claimed it."""
        if key in self._pending:
            return None
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        return future

    def release(self, key: bytes, future: asyncio.Future, record: dict[str, Any] | None = None,
                semantic: SemanticQuery | None = None) -> None:
        """End a :meth:`claim`: store ``record`` (None: the request gave no answer) and wake the waiters."""
        if record is not None:
            self.store(key, record, semantic)
        if self._pending.get(key) is future:
            del self._pending[key]
        if not future.done():
            future.set_result(record)

    def store(self, key: bytes, record: dict[str, Any], semantic: SemanticQuery | None = None) -> bool:
        """Put an answer in the cache, with its question in the semantic index (its bytes charged to the answer's
        entry); False when it alone exceeds the bound (nothing stored)."""
        use_index = semantic is not None and self.index is not None
        extra = self.index.entry_nbytes(semantic.vector, semantic.signature) if use_index else 0
        if not self.cache.put(key, pickle.dumps(record, protocol=5), extra):
            return False
        if use_index:
            self.index.add(key, semantic.context_key, semantic.vector, semantic.signature)
        return True

    def recording(self, stream: Any, key: bytes, future: asyncio.Future,
                  semantic: SemanticQuery | None = None) -> RecordingStream:
        """``stream`` recorded into the cache under ``key`` (claimed with ``future``)."""
        return RecordingStream(stream, lambda record: self.release(key, future, record, semantic))

    async def follow(self, key: bytes, arrival: float, admitted: AdmittedRequest) -> CachedStream | None:
        """When an identical request is running (its answer not yet cached), wait for it and replay its answer
        (a hit); None when none is running or it ended without an answer (the caller runs the request)."""
        future = self._pending.get(key)
        if future is None:
            return None
        record = await asyncio.shield(future)
        if record is None:
            return None
        self.hits.labels(self.model_name, "exact").inc()
        return CachedStream(record, admitted.prompt_token_ids, arrival)


@dataclass(frozen=True)
class SemanticQuery:
    context_key: bytes
    vector: Any  # numpy (dim,) float32, L2-normalized
    signature: Any  # query_signature of the question


_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, tuple[Counter, Counter, Gauge, Gauge]] = (
    weakref.WeakKeyDictionary())


def _counters(registry: CollectorRegistry | None) -> tuple[Counter, Counter, Gauge, Gauge]:
    """The (queries, hits) counters and the (bytes, entries) gauges in ``registry``, registered once per registry
    (the answer caches of several models in one server share them, each with its ``model_name`` series)."""
    if registry is not None and registry in _COUNTERS:
        return _COUNTERS[registry]
    counters = (Counter(names.ANSWER_CACHE_QUERIES, "Deterministic requests looked up in the answer cache.",
                        [names.MODEL_NAME_LABEL], registry=registry),
                Counter(names.ANSWER_CACHE_HITS, "Requests answered from the answer cache, by kind.",
                        [names.MODEL_NAME_LABEL, names.CACHE_KIND_LABEL], registry=registry),
                Gauge(names.ANSWER_CACHE_BYTES, "Bytes the answer cache holds (answers and their semantic index "
                      "entries; bounded by --answer-cache-bytes).", [names.MODEL_NAME_LABEL], registry=registry),
                Gauge(names.ANSWER_CACHE_ENTRIES, "Answers the answer cache holds.", [names.MODEL_NAME_LABEL],
                      registry=registry))
    if registry is not None:
        _COUNTERS[registry] = counters
    return counters


def _params(admitted: AdmittedRequest) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(admitted.params).items() if k != "speculative"}


def answer_cache_of(raw_request: Request) -> ServingAnswerCache | None:
    """The answer cache of the request's model: ``request.state.answer_cache`` when the route set it (several
    models: each has its own), else the app's."""
    state = raw_request.scope.get("state") or {}
    if "answer_cache" in state:
        return state["answer_cache"]
    return getattr(raw_request.app.state, "answer_cache", None)


async def submit(raw_request: Request, endpoint: str, admitted: list[AdmittedRequest], arrival: float,
                 use_cache: bool, add: Callable[[list[AdmittedRequest]], Awaitable[list[Any]]],
                 question: tuple[str, Any] | None = None) -> tuple[list[Any], str | None]:
    """The request's streams, from the cache where it hits and from ``add`` (``serving_common.add_all``) for the
    rest; and the verdict: None (no cache), "bypass" (``cache: false`` or not deterministic), "hit" (all
    prompts hit) or "miss". ``question``: (the last user message, the rest of the context) of a chat request,
    for the semantic cache."""
    cache = answer_cache_of(raw_request)
    if cache is None:
        return await add(admitted), None
    params = admitted[0].params
    if not use_cache or not is_deterministic(params.temperature, params.seed) or params.prompt_logprobs is not None:
        return await add(admitted), "bypass"  # prompt logprobs are not replayed: such requests run
    keys = [cache.key(raw_request, endpoint, a) for a in admitted]
    sem = None
    if question is not None and len(admitted) == 1:
        sem = cache.semantic_query(raw_request, endpoint, admitted[0], question[0], question[1])
    hits: list[Any] = [cache.lookup(k, arrival, a, sem) for k, a in zip(keys, admitted, strict=True)]
    for i, h in enumerate(hits):  # an identical request in flight: wait for its answer (request coalescing)
        if h is None and keys[i] in cache._pending:
            hits[i] = await cache.follow(keys[i], arrival, admitted[i])
    misses = [i for i, h in enumerate(hits) if h is None]
    claims = {i: cache.claim(keys[i]) for i in misses}
    try:
        live = await add([admitted[i] for i in misses]) if misses else []
    except BaseException:
        for i, future in claims.items():
            if future is not None:
                cache.release(keys[i], future)
        raise
    streams: list[Any] = list(hits)
    for i, s in zip(misses, live, strict=True):
        streams[i] = s if claims[i] is None else cache.recording(s, keys[i], claims[i], sem)
    return streams, "miss" if misses else "hit"


def mark(response: Any, verdict: str | None) -> Any:
    """``response`` with the ``x-leanserve-cache`` header when the cache was consulted (hit or miss)."""
    if verdict in ("hit", "miss"):
        response.headers[CACHE_HEADER] = verdict
    return response


class RecordingStream:
    """A request stream passed through, recording each snapshot's boundaries. ``on_done`` is called once: with
    the record when the request finished with no choice aborted, else with None (aborted, failed, or the
    consumer stopped or closed it first)."""

    def __init__(self, stream: Any, on_done: Callable[[dict[str, Any] | None], Any]) -> None:
        self._stream = stream
        self._on_done = on_done
        self._settled = False
        self._steps: list[list[tuple[int, int, int, bool]]] = []

    def _settle(self, record: dict[str, Any] | None) -> None:
        if not self._settled:
            self._settled = True
            self._on_done(record)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self._stream:
                self._steps.append([(o.index, len(o.text), len(o.token_ids), o.finish_reason is not None)
                                    for o in out.outputs])
                if out.finished and all(o.finish_reason not in (None, "abort") for o in out.outputs):
                    self._settle({"steps": self._steps, "num_cached_tokens": out.num_cached_tokens,
                                  "outputs": [(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason,
                                               o.logprobs, o.cumulative_logprob) for o in out.outputs]})
                yield out
        finally:
            self._settle(None)

    def abort(self) -> None:
        self._settle(None)
        self._stream.abort()

    async def aclose(self) -> None:
        self._settle(None)
        await self._stream.aclose()

    async def accepted(self) -> None:
        await self._stream.accepted()


class CachedStream:
    """A finished answer replayed as the engine streamed it: one snapshot per recorded step."""

    def __init__(self, record: dict[str, Any], prompt_token_ids: list[int], arrival: float) -> None:
        self._record = record
        self._prompt = prompt_token_ids
        self._arrival = arrival

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        rec = self._record
        finals = {o[0]: o for o in rec["outputs"]}
        now = time.monotonic()
        steps = rec["steps"]
        for k, step in enumerate(steps):
            outs = []
            for index, nchars, ntoks, done in step:
                _, text, ids, reason, stop, lps, cum = finals[index]
                m = RequestMetrics(self._arrival, first_scheduled_time=now, first_token_time=now,
                                   last_token_time=time.monotonic(), finished_time=time.monotonic() if done else None,
                                   num_generation_tokens=ntoks)
                outs.append(CompletionOutput(index, text[:nchars], list(ids[:ntoks]), reason if done else None,
                                             stop if done else None, None if lps is None else lps[:ntoks],
                                             cum if done else None, metrics=m))
            last = k == len(steps) - 1
            yield RequestOutput("cached", None, self._prompt, outs, finished=last,
                                num_cached_tokens=rec["num_cached_tokens"], metrics=outs[0].metrics if outs else None)

    @property
    def replayed_tokens(self) -> int:
        """Prompt tokens this replay reports but nobody computed now beyond its recorded ``cached_tokens``."""
        return len(self._prompt) - self._record["num_cached_tokens"]

    def abort(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def accepted(self) -> None:
        pass
