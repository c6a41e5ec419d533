"""Prometheus metrics of one server (vLLM's names and ``model_name`` label, from :mod:`leanserve.metric_names`),
in a registry of its own; with several models each metric family is registered once in that registry and every
model adds its own ``model_name`` series (:class:`ServerMetrics` with a shared ``registry``).

Request-level histograms get one observation per request, when it ends (any reason; the server's own internal
requests, a history summary's, are no client's: skipped there and in ``request_success``, their tokens
counted); inter-token latency gets one per generated token after the first. Gauges and the prefix-cache /
preemption counters are read from the async engine's stats snapshot at scrape time. Process memory comes from
prometheus_client's process collector; GPU memory (:data:`~leanserve.metric_names.GPU_GAUGES`) is exported when
torch sees CUDA.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from leanserve import metric_names as names
from leanserve.engine.async_engine import AsyncEngineStats
from leanserve.engine.llm_engine import EngineStats
from leanserve.entrypoints.openai.history_summary import INTERNAL_REQUEST_PREFIX
from leanserve.outputs import RequestOutput

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets, exp = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exp
            if value > max_value:
                return buckets
            buckets.append(value)
        exp += 1


@dataclass(frozen=True)
class RequestSummary:
    """Per-request latencies in seconds (None when the request never got that far) and token counts.

    With n > 1 choices: TTFT and queue time from the earliest choice, decode time from the first token of any
    choice to the last token of any, TPOT over the longest choice.
    """

    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int  # over all choices
    queue_time: float | None
    ttft: float | None
    prefill_time: float | None
    decode_time: float | None
    tpot: float | None
    e2e_latency: float | None


def summarize(out: RequestOutput) -> RequestSummary:
    """The :class:`RequestSummary` of a (finished) request output."""
    metrics = [o.metrics for o in out.outputs if o.metrics is not None] or (
        [out.metrics] if out.metrics is not None else [])
    arrival = metrics[0].arrival_time if metrics else None

    def first(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None

    def last(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    scheduled = first(m.first_scheduled_time for m in metrics)
    first_token = first(m.first_token_time for m in metrics)
    last_token = last(m.last_token_time for m in metrics)
    finished = last(m.finished_time for m in metrics)
    queue = None if scheduled is None or arrival is None else scheduled - arrival
    ttft = None if first_token is None or arrival is None else first_token - arrival
    prefill = None if first_token is None or scheduled is None else first_token - scheduled
    decode = None if first_token is None or last_token is None else last_token - first_token
    longest = max((len(o.token_ids) for o in out.outputs), default=0)
    tpot = decode / (longest - 1) if decode is not None and longest >= 2 else None
    e2e = None if finished is None or arrival is None else finished - arrival
    return RequestSummary(len(out.prompt_token_ids), out.num_cached_tokens, sum(len(o.token_ids) for o in out.outputs),
                          queue, ttft, prefill, decode, tpot, e2e)


class _EngineCollector(Collector):
    """Gauges and cumulative counters read from each engine's stats snapshot at scrape time: one metric family
    per name, one sample per served model (``model_name``)."""

    def __init__(self) -> None:
        self._engines: list[tuple[str, Callable[[], AsyncEngineStats]]] = []

    def add(self, model_name: str, stats: Callable[[], AsyncEngineStats]) -> None:
        self._engines.append((model_name, stats))

    def collect(self) -> Iterable[Metric]:
        snapshots = [([model], stats()) for model, stats in self._engines]
        for name, value in (
            (names.NUM_REQUESTS_RUNNING, lambda s: s.num_running),
            (names.NUM_REQUESTS_WAITING, lambda s: s.num_waiting),
            (names.KV_CACHE_USAGE_PERC, lambda s: s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, names.HELP[name], labels=[names.MODEL_NAME_LABEL])
            for labels, s in snapshots:
                g.add_metric(labels, value(s))
            yield g
        for name, value in (
            (names.NUM_PREEMPTIONS, lambda e: e.num_preemptions),
            (names.PREFIX_CACHE_QUERIES, lambda e: e.prefix_cache_queries),
            (names.PREFIX_CACHE_HITS, lambda e: e.prefix_cache_hits),
            (names.SPEC_DECODE_NUM_DRAFTS, lambda e: e.spec_num_drafts),
            (names.SPEC_DECODE_NUM_DRAFT_TOKENS, lambda e: e.spec_num_draft_tokens),
            (names.SPEC_DECODE_NUM_ACCEPTED_TOKENS, lambda e: e.spec_num_accepted_tokens),
        ):
            c = CounterMetricFamily(name, names.HELP[name], labels=[names.MODEL_NAME_LABEL])
            for labels, s in snapshots:
                e: EngineStats = s.engine
                c.add_metric(labels, value(e))
            yield c
        name = names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS
        c = CounterMetricFamily(name, names.HELP[name], labels=[names.MODEL_NAME_LABEL, names.POSITION_LABEL])
        for labels, s in snapshots:
            for pos, value in enumerate(s.engine.spec_accepted_per_pos):
                c.add_metric([*labels, str(pos)], value)
        yield c


class _GpuCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        import torch

        allocated, reserved = (GaugeMetricFamily(name, names.HELP[name], labels=[names.DEVICE_LABEL])
                               for name in (names.GPU_MEMORY_ALLOCATED_BYTES, names.GPU_MEMORY_RESERVED_BYTES))
        for i in range(torch.cuda.device_count()):
            allocated.add_metric([str(i)], torch.cuda.memory_allocated(i))
            reserved.add_metric([str(i)], torch.cuda.memory_reserved(i))
        yield allocated
        yield reserved


class _Families:
    """The metric families of one registry (unlabelled collectors), shared by every model served into it."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int) -> None:
        r, label = registry, [names.MODEL_NAME_LABEL]
        self.counters = {name: Counter(name, names.HELP[name], label, registry=r)
                         for name in (names.PROMPT_TOKENS, names.GENERATION_TOKENS)}
        self.success = Counter(names.REQUEST_SUCCESS, names.HELP[names.REQUEST_SUCCESS],
                               [names.MODEL_NAME_LABEL, names.FINISHED_REASON_LABEL], registry=r)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.histograms = {name: Histogram(name, names.HELP[name], label, buckets=buckets, registry=r)
                           for name, buckets in (
            (names.TIME_TO_FIRST_TOKEN_SECONDS, TTFT_BUCKETS),
            (names.INTER_TOKEN_LATENCY_SECONDS, TOKEN_LATENCY_BUCKETS),
            (names.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS, TOKEN_LATENCY_BUCKETS),
            (names.E2E_REQUEST_LATENCY_SECONDS, REQUEST_LATENCY_BUCKETS),
            (names.REQUEST_QUEUE_TIME_SECONDS, REQUEST_LATENCY_BUCKETS),
            (names.REQUEST_PREFILL_TIME_SECONDS, REQUEST_LATENCY_BUCKETS),
            (names.REQUEST_DECODE_TIME_SECONDS, REQUEST_LATENCY_BUCKETS),
            (names.REQUEST_PROMPT_TOKENS, token_buckets),
            (names.REQUEST_GENERATION_TOKENS, token_buckets),
        )}
        self.engines = _EngineCollector()
        r.register(self.engines)
        ProcessCollector(registry=r)
        try:
            import torch

            if torch.cuda.is_available():
                r.register(_GpuCollector())
        except ImportError:  # pragma: no cover - torch is a dependency
            pass


_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()


class ServerMetrics:
    """The metrics of one served model. Register it with ``async_engine.add_observer(metrics)``; render with
    :meth:`render`.

    Args:
        model_name: value of the ``model_name`` label.
        stats: returns the engine's current :class:`AsyncEngineStats` (cheap, thread-safe).
        max_model_len: top of the token-count buckets.
        registry: the registry to add this model's series to (several models in one server share one: each metric
            family is registered once, each model adds its ``model_name`` series; the token-count buckets are those
            of the first model's ``max_model_len``, so pass the largest); None: a registry of its own.
    """

    def __init__(self, model_name: str, stats: Callable[[], AsyncEngineStats], max_model_len: int,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        families = _FAMILIES.get(self.registry)
        if families is None:
            families = _FAMILIES[self.registry] = _Families(self.registry, max_model_len)
        h = families.histograms
        self.prompt_tokens = families.counters[names.PROMPT_TOKENS].labels(model_name)
        self.generation_tokens = families.counters[names.GENERATION_TOKENS].labels(model_name)
        self._success = families.success
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self.ttft = h[names.TIME_TO_FIRST_TOKEN_SECONDS].labels(model_name)
        self.itl = h[names.INTER_TOKEN_LATENCY_SECONDS].labels(model_name)
        self.tpot = h[names.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS].labels(model_name)
        self.e2e = h[names.E2E_REQUEST_LATENCY_SECONDS].labels(model_name)
        self.queue = h[names.REQUEST_QUEUE_TIME_SECONDS].labels(model_name)
        self.prefill = h[names.REQUEST_PREFILL_TIME_SECONDS].labels(model_name)
        self.decode = h[names.REQUEST_DECODE_TIME_SECONDS].labels(model_name)
        self.request_prompt_tokens = h[names.REQUEST_PROMPT_TOKENS].labels(model_name)
        self.request_generation_tokens = h[names.REQUEST_GENERATION_TOKENS].labels(model_name)
        families.engines.add(model_name, stats)
        # Engine-thread state: per (request, choice) tokens seen and time of the last one; requests prefilled.
        self._seen: dict[tuple[str, int], tuple[int, float | None]] = {}
        self._prefilled: set[str] = set()

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """Engine thread: count tokens, observe inter-token gaps, and per-request histograms at the end."""
        for out in outputs:
            rid = out.request_id
            for o in out.outputs:
                key = (rid, o.index)
                seen, last_time = self._seen.get(key, (0, None))
                new = len(o.token_ids) - seen
                if new <= 0:
                    continue
                now = o.metrics.last_token_time if o.metrics is not None else None
                self.generation_tokens.inc(new)
                if last_time is not None and now is not None:
                    gap = (now - last_time) / new
                    for _ in range(new):
                        self.itl.observe(gap)
                self._seen[key] = (len(o.token_ids), now)
                if rid not in self._prefilled:
                    self._prefilled.add(rid)
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.finished:
                self._request_done(out)

    def _request_done(self, out: RequestOutput) -> None:
        for o in out.outputs:
            self._seen.pop((out.request_id, o.index), None)
        self._prefilled.discard(out.request_id)
        if out.request_id.startswith(INTERNAL_REQUEST_PREFIX):  # the server's own (a history summary): no client's
            return
        reason = out.outputs[0].finish_reason or "abort"
        self._success.labels(self._model_name, reason).inc()
        s = summarize(out)
        for hist, value in ((self.ttft, s.ttft), (self.tpot, s.tpot), (self.e2e, s.e2e_latency),
                            (self.queue, s.queue_time), (self.prefill, s.prefill_time), (self.decode, s.decode_time)):
            if value is not None:
                hist.observe(max(value, 0.0))
        self.request_prompt_tokens.observe(s.num_prompt_tokens)
        self.request_generation_tokens.observe(s.num_generation_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


# Per-tenant metrics (label ``tenant``: the tenant's name, never its key).
TENANT_LABEL = "tenant"
TENANT_REQUESTS = "leanserve:tenant_requests_total"
TENANT_RATE_LIMITED = "leanserve:tenant_rate_limited_total"
TENANT_PROMPT_TOKENS = "leanserve:tenant_prompt_tokens_total"
TENANT_GENERATION_TOKENS = "leanserve:tenant_generation_tokens_total"
TENANT_IN_FLIGHT = "leanserve:tenant_requests_in_flight"


class TenantMetrics:
    """Counters per tenant in ``registry`` (the server's): generation requests admitted, refused with 429 (label
    ``limit``), prompt and generated tokens, and requests in flight."""

    def __init__(self, registry: CollectorRegistry, model_name: str, tenant_names: list[str]) -> None:
        labels = [names.MODEL_NAME_LABEL, TENANT_LABEL]
        self._model = model_name
        self._requests = Counter(TENANT_REQUESTS, "Generation requests admitted, per tenant.", labels,
                                 registry=registry)
        self._limited = Counter(TENANT_RATE_LIMITED, "Requests refused with 429 by a tenant limit.",
                                [*labels, "limit"], registry=registry)
        self._prompt = Counter(TENANT_PROMPT_TOKENS, "Prompt tokens of finished requests, per tenant.", labels,
                               registry=registry)
        self._generation = Counter(TENANT_GENERATION_TOKENS, "Generated tokens of finished requests, per tenant.",
                                   labels, registry=registry)
        self._in_flight = Gauge(TENANT_IN_FLIGHT, "Generation requests in flight, per tenant.", labels,
                                registry=registry)
        for t in tenant_names:  # every tenant shows from the start, at 0
            for m in (self._requests, self._prompt, self._generation, self._in_flight):
                m.labels(model_name, t)

    def request_admitted(self, tenant: str) -> None:
        self._requests.labels(self._model, tenant).inc()
        self._in_flight.labels(self._model, tenant).inc()

    def request_done(self, tenant: str) -> None:
        self._in_flight.labels(self._model, tenant).dec()

    def rate_limited(self, tenant: str, limit: str) -> None:
        self._limited.labels(self._model, tenant, limit).inc()

    def tokens(self, tenant: str, prompt: int, generated: int) -> None:
        self._prompt.labels(self._model, tenant).inc(prompt)
        self._generation.labels(self._model, tenant).inc(generated)
