"""What the server itself saw during a run, from its Prometheus ``/metrics`` (the names leanserve exports, from
:mod:`leanserve.metric_names`, then the peer servers' aliases listed there where leanserve's are absent): scraped
before and after the run and polled during it for peaks. Servers without ``/metrics`` give no report."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from leanserve import metric_names as names
from leanserve.metric_names import counter_sample, histogram_count, histogram_sum

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Sample names read from a scrape, leanserve's first, then the peer servers' aliases.
KV_USAGE = (names.KV_CACHE_USAGE_PERC, *names.KV_CACHE_USAGE_PERC_ALIASES)
RUNNING = (names.NUM_REQUESTS_RUNNING, *names.NUM_REQUESTS_RUNNING_ALIASES)
WAITING = (names.NUM_REQUESTS_WAITING, *names.NUM_REQUESTS_WAITING_ALIASES)
PREEMPTIONS = (counter_sample(names.NUM_PREEMPTIONS),)
PREFIX_QUERIES = tuple(map(counter_sample, (names.PREFIX_CACHE_QUERIES, *names.PREFIX_CACHE_QUERIES_ALIASES)))
PREFIX_HITS = tuple(map(counter_sample, (names.PREFIX_CACHE_HITS, *names.PREFIX_CACHE_HITS_ALIASES)))
QUEUE_SUM = (histogram_sum(names.REQUEST_QUEUE_TIME_SECONDS),)
QUEUE_COUNT = (histogram_count(names.REQUEST_QUEUE_TIME_SECONDS),)
SPEC_DRAFTS = (counter_sample(names.SPEC_DECODE_NUM_DRAFTS),)
SPEC_DRAFT_TOKENS = (counter_sample(names.SPEC_DECODE_NUM_DRAFT_TOKENS),)
SPEC_ACCEPTED = (counter_sample(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS),)


def parse_samples(text: str) -> dict[str, float]:
    """Prometheus text -> ``{sample name: value summed over label sets}`` (histogram buckets left out).

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" in s.labels or "quantile" in s.labels or math.isnan(s.value):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def pick(samples: dict[str, float], names: tuple[str, ...]) -> float | None:
    """The value of the first of ``names`` present in ``samples``, else None."""
    return next((samples[n] for n in names if n in samples), None)


@dataclass
class ServerMetricsReport:
    """Server-side view of a run (None where the server exports no such metric).

    Attributes:
        peak_kv_cache_usage_perc: highest KV-cache usage seen while polling, 0..1.
        peak_num_requests_running / peak_num_requests_waiting: highest gauges seen while polling.
        num_preemptions: preemptions during the run.
        prefix_cache_hit_rate: prompt tokens found in the prefix cache / prompt tokens looked up, 0..1.
        mean_queue_time_ms: mean time requests finished during the run waited before their first scheduling.
        spec_acceptance_rate: speculative decoding's accepted / verified draft tokens during the run, 0..1 (None
            without speculation).
        spec_mean_acceptance_length: tokens per verification, 1 + accepted / verifications (vLLM's definition).
        num_scrapes: successful scrapes (before, during and after).
    """

    peak_kv_cache_usage_perc: float | None = None
    peak_num_requests_running: float | None = None
    peak_num_requests_waiting: float | None = None
    num_preemptions: float | None = None
    prefix_cache_hit_rate: float | None = None
    mean_queue_time_ms: float | None = None
    spec_acceptance_rate: float | None = None
    spec_mean_acceptance_length: float | None = None
    num_scrapes: int = 0


def _delta(before: dict[str, float], after: dict[str, float], names: tuple[str, ...]) -> float | None:
    a, b = pick(after, names), pick(before, names)
    return None if a is None or b is None else a - b


class MetricsPoller:
    """Scrapes ``/metrics`` on an httpx client: :meth:`start` (first scrape and a polling task every ``interval_s``
    seconds), :meth:`stop` (last scrape, the :class:`ServerMetricsReport`, or None when ``/metrics`` is absent)."""

    def __init__(self, client: httpx.AsyncClient, interval_s: float = 0.5) -> None:
        self._client = client
        self._interval = interval_s
        self._before: dict[str, float] | None = None
        self._peaks: dict[str, float] = {}
        self._scrapes = 0
        self._task: asyncio.Task | None = None

    async def scrape(self) -> dict[str, float] | None:
        """One scrape; None when the server has no usable ``/metrics``. Peaks of the gauges are updated."""
        try:
            resp = await self._client.get("/metrics", timeout=10.0)
            if resp.status_code != 200:
                return None
            samples = parse_samples(resp.text)
        except (httpx.HTTPError, ValueError):
            return None
        self._scrapes += 1
        for key, sample_names in (("kv", KV_USAGE), ("running", RUNNING), ("waiting", WAITING)):
            value = pick(samples, sample_names)
            if value is not None:
                self._peaks[key] = max(self._peaks.get(key, value), value)
        return samples

    async def start(self) -> None:
        """Take the 'before' scrape and start polling."""
        self._before = await self.scrape()
        if self._before is not None:
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.scrape()

    async def stop(self) -> ServerMetricsReport | None:
        """Stop polling, take the 'after' scrape and compare it with the 'before' one."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._before is None:
            return None
        after = await self.scrape()
        if after is None:
            return None
        queries, hits = _delta(self._before, after, PREFIX_QUERIES), _delta(self._before, after, PREFIX_HITS)
        qsum, qcount = _delta(self._before, after, QUEUE_SUM), _delta(self._before, after, QUEUE_COUNT)
        drafts, draft_tokens, accepted = (_delta(self._before, after, n)
                                          for n in (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED))
        return ServerMetricsReport(
            peak_kv_cache_usage_perc=self._peaks.get("kv"),
            peak_num_requests_running=self._peaks.get("running"),
            peak_num_requests_waiting=self._peaks.get("waiting"),
            num_preemptions=_delta(self._before, after, PREEMPTIONS),
            prefix_cache_hit_rate=hits / queries if queries and hits is not None else None,
            mean_queue_time_ms=1000.0 * qsum / qcount if qcount and qsum is not None else None,
            spec_acceptance_rate=accepted / draft_tokens if draft_tokens and accepted is not None else None,
            spec_mean_acceptance_length=1 + accepted / drafts if drafts and accepted is not None else None,
            num_scrapes=self._scrapes)
