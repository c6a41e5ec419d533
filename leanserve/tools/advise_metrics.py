"""Reading a server's Prometheus ``/metrics`` for ``leanserve advise``: scrapes (:func:`parse_scrape`, histogram
buckets kept), a sampling window (:func:`sample_window`: a first scrape, gauge polls, a last scrape), and the
window's :class:`~leanserve.tools.advise_snapshot.Snapshot` (:func:`snapshot_from_window`).

Names come from :mod:`leanserve.metric_names`: leanserve's (vLLM's) first, then the peers' aliases listed there
(llama.cpp's ``llamacpp:*``, vLLM V0's). Counters and histograms are read as the difference between the last and
the first scrape; when nothing finished during the window but the server has served requests before, the
cumulative values since the server started are used instead (scope "since start", no throughputs). Histogram
quantiles are interpolated inside the buckets the way PromQL's ``histogram_quantile`` does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from leanserve import metric_names as names
from leanserve.metric_names import counter_sample, histogram_count, histogram_sum
from leanserve.tools.advise_snapshot import Dist, Snapshot, fill_unseen

import httpx
from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = (names.KV_CACHE_USAGE_PERC, *names.KV_CACHE_USAGE_PERC_ALIASES)
RUNNING = (names.NUM_REQUESTS_RUNNING, *names.NUM_REQUESTS_RUNNING_ALIASES)
WAITING = (names.NUM_REQUESTS_WAITING, *names.NUM_REQUESTS_WAITING_ALIASES)
PROMPT_TOKENS = tuple(map(counter_sample, (names.PROMPT_TOKENS, *names.PROMPT_TOKENS_ALIASES)))
GENERATION_TOKENS = tuple(map(counter_sample, (names.GENERATION_TOKENS, *names.GENERATION_TOKENS_ALIASES)))
PREFIX_QUERIES = tuple(map(counter_sample, (names.PREFIX_CACHE_QUERIES, *names.PREFIX_CACHE_QUERIES_ALIASES)))
PREFIX_HITS = tuple(map(counter_sample, (names.PREFIX_CACHE_HITS, *names.PREFIX_CACHE_HITS_ALIASES)))
PREEMPTIONS = (counter_sample(names.NUM_PREEMPTIONS),)
SPEC_DRAFT = (counter_sample(names.SPEC_DECODE_NUM_DRAFT_TOKENS),)
SPEC_ACCEPTED = (counter_sample(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS),)
ANSWER_QUERIES = (counter_sample(names.ANSWER_CACHE_QUERIES),)
ANSWER_HITS = (counter_sample(names.ANSWER_CACHE_HITS),)
LLAMA_PROMPT_S = (counter_sample(names.LLAMACPP_PROMPT_SECONDS),)
LLAMA_PREDICTED_S = (counter_sample(names.LLAMACPP_PREDICTED_SECONDS),)
LLAMA_BUSY_SLOTS = (names.LLAMACPP_BUSY_SLOTS_PER_DECODE,)
SUCCESS = counter_sample(names.REQUEST_SUCCESS)


@dataclass
class Scrape:
    """One scrape of ``/metrics``.

    Attributes:
        t: ``time.monotonic()`` when it was taken (seconds).
        samples: sample name -> value summed over label sets (histogram buckets and NaNs left out).
        buckets: histogram name -> ``[(le, cumulative count)]`` ascending (``le`` may be inf), summed over labels.
        finish_reasons: the ``finished_reason`` label of ``vllm:request_success_total`` -> count.
    """

    t: float = 0.0
    samples: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    finish_reasons: dict[str, float] = field(default_factory=dict)


def parse_scrape(text: str, t: float = 0.0) -> Scrape:
    """Prometheus text exposition -> :class:`Scrape`.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    out = Scrape(t)
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if math.isnan(s.value) or "quantile" in s.labels:
                continue
            if "le" in s.labels:
                if s.name.endswith("_bucket"):
                    per = buckets.setdefault(s.name[: -len("_bucket")], {})
                    le = float(s.labels["le"])
                    per[le] = per.get(le, 0.0) + s.value
                continue
            out.samples[s.name] = out.samples.get(s.name, 0.0) + s.value
            reason = s.labels.get(names.FINISHED_REASON_LABEL)
            if s.name == SUCCESS and reason is not None:
                out.finish_reasons[reason] = out.finish_reasons.get(reason, 0.0) + s.value
    out.buckets = {name: sorted(per.items()) for name, per in buckets.items()}
    return out


def pick(samples: dict[str, float], sample_names: tuple[str, ...]) -> float | None:
    """The value of the first of ``sample_names`` present in ``samples``, else None."""
    return next((samples[n] for n in sample_names if n in samples), None)


def histogram_quantile(buckets: list[tuple[float, float]], q: float, mean: float | None = None) -> float | None:
    """The ``q`` quantile (0..1) of cumulative ``[(le, count)]`` buckets, interpolated linearly inside the bucket
    that holds it (lower bound 0 for the first), as PromQL's ``histogram_quantile``; the largest finite bound when
    it falls in the ``+Inf`` bucket. None when the histogram is empty.

    With the observations' ``mean`` (sum / count), the estimate is kept within what the data allow: the
    observations lie in ``[lo, hi]`` (the lower bound of the first non-empty bucket, the upper bound of the last;
    ``hi`` infinite when ``+Inf`` holds some), narrowed by the sum (no one of ``n`` observations exceeds
    ``lo + n (mean - lo)``, none is under ``hi - n (hi - mean)``); since at least a ``1 - q`` share of them is >=
    the quantile and a ``q`` share <= it, ``hi - (hi - mean) / q <= quantile <= lo + (mean - lo) / (1 - q)``.
    Without this a coarse first bucket (all requests under its bound) puts the median at half the bound, possibly
    far above the mean.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    estimate = None
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > prev_count:
            estimate = prev_le if math.isinf(le) else prev_le + (le - prev_le) * (rank - prev_count) / (
                count - prev_count)
            break
        prev_le, prev_count = (prev_le if math.isinf(le) else le), count
    if estimate is None:
        estimate = prev_le
    if mean is None:
        return estimate
    if total == 1:
        return mean
    lows = [0.0] + [le for le, _ in buckets]
    lo = next(lows[i] for i, (_, c) in enumerate(buckets) if c > 0)
    hi = next(le for le, c in buckets if c >= total)
    hi = min(hi, lo + total * (mean - lo))  # no observation exceeds the sum less the others' least
    if not math.isinf(hi):
        lo = max(lo, hi - total * (hi - mean))
    upper = lo + (mean - lo) / (1.0 - q) if q < 1.0 else hi
    lower = hi - (hi - mean) / q if q > 0.0 and not math.isinf(hi) else lo
    return min(max(estimate, lower, lo), upper, hi)


@dataclass
class Window:
    """What :func:`sample_window` saw: the first and last scrapes and the gauges polled in between.

    ``polls``: ``(seconds since the first scrape, KV usage, running, waiting)``, None where not exported.
    """

    first: Scrape
    last: Scrape
    polls: list[tuple[float, float | None, float | None, float | None]] = field(default_factory=list)


def _gauges(s: Scrape, since: float) -> tuple[float, float | None, float | None, float | None]:
    return (s.t - since, pick(s.samples, KV_USAGE), pick(s.samples, RUNNING), pick(s.samples, WAITING))


def sample_window(base_url: str, duration_s: float, interval_s: float = 0.5, api_key: str | None = None,
                  sleep: Callable[[float], None] = time.sleep) -> Window | None:
    """Scrape ``base_url/metrics`` now, every ``interval_s`` seconds for ``duration_s`` seconds, and at the end.

    Returns None when the server has no usable ``/metrics`` (connection refused, not 200, not Prometheus text).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def scrape(client: httpx.Client) -> Scrape | None:
        try:
            resp = client.get("/metrics", timeout=10.0)
            return parse_scrape(resp.text, time.monotonic()) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    with httpx.Client(base_url=base_url, headers=headers) as client:
        first = scrape(client)
        if first is None:
            return None
        polls = [_gauges(first, first.t)]
        last = first
        end = first.t + duration_s
        while time.monotonic() < end:
            sleep(min(interval_s, max(0.0, end - time.monotonic())))
            now = scrape(client)
            if now is not None:
                last = now
                polls.append(_gauges(now, first.t))
    return Window(first, last, polls)


def model_card(base_url: str, api_key: str | None = None) -> tuple[str | None, str | None, int | None]:
    """``(owned_by, id, max_model_len)`` of the first model of ``GET /v1/models``; Nones when unavailable."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
        card = resp.json()["data"][0] if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        card = {}
    length = card.get("max_model_len")
    return card.get("owned_by"), card.get("id"), int(length) if isinstance(length, int | float) else None


def server_kind(samples: dict[str, float], owned_by: str | None) -> str:
    """"leanserve", "vllm", "llama.cpp" or "unknown", from ``/v1/models``' ``owned_by`` and the metric names."""
    if owned_by in ("leanserve", "vllm"):
        return owned_by
    if owned_by == "llamacpp" or any(n.startswith("llamacpp:") for n in samples):
        return "llama.cpp"
    if any(n.startswith("vllm:") for n in samples):
        return "vllm"
    return "unknown"


class _Delta:
    """Counter and histogram differences between two scrapes."""

    def __init__(self, first: Scrape, last: Scrape) -> None:
        self.first, self.last = first, last

    def counter(self, sample_names: tuple[str, ...]) -> float | None:
        a = pick(self.last.samples, sample_names)
        return None if a is None else a - (pick(self.first.samples, sample_names) or 0.0)

    def ratio(self, num: tuple[str, ...], den: tuple[str, ...]) -> float | None:
        n, d = self.counter(num), self.counter(den)
        return None if n is None or not d else n / d

    def buckets(self, name: str) -> list[tuple[float, float]] | None:
        if name not in self.last.buckets:
            return None
        before = dict(self.first.buckets.get(name, []))
        return [(le, c - before.get(le, 0.0)) for le, c in self.last.buckets[name]]

    def dist(self, name: str, scale: float = 1.0) -> Dist | None:
        """Mean (sum / count), p50 and p99 of histogram ``name``, times ``scale``; None when it is not exported."""
        count = self.counter((histogram_count(name),))
        total = self.counter((histogram_sum(name),))
        buckets = self.buckets(name)
        if count is None or total is None:
            return None
        if count <= 0:
            return Dist(None, None, None, 0, exact=False)

        def q(p: float) -> float | None:
            v = histogram_quantile(buckets or [], p, total / count)
            return None if v is None else v * scale
        return Dist(total / count * scale, q(0.5), q(0.99), int(round(count)), exact=False)

    def sum(self, name: str) -> float | None:
        return self.counter((histogram_sum(name),))


def snapshot_from_window(w: Window, owned_by: str | None = None, model: str | None = None,
                         max_model_len: int | None = None) -> Snapshot:
    """The :class:`Snapshot` of a window (see the module doc for "window" vs "since start")."""
    kind = server_kind(w.last.samples, owned_by)
    first, scope, window_s = w.first, "window", w.last.t - w.first.t
    d = _Delta(first, w.last)
    finished = d.counter((histogram_count(names.E2E_REQUEST_LATENCY_SECONDS),))
    generated = d.counter(GENERATION_TOKENS)
    traffic = bool(finished) or bool(generated)
    if not traffic and ((pick(w.last.samples, GENERATION_TOKENS) or 0) > 0):
        first, scope, window_s = Scrape(), "since start", None
        d = _Delta(first, w.last)
        finished = d.counter((histogram_count(names.E2E_REQUEST_LATENCY_SECONDS),))

    def per_s(v: float | None) -> float | None:
        return None if v is None or not window_s else v / window_s
    s = Snapshot(server_kind=kind, model=model, max_model_len=max_model_len, scope=scope, window_s=window_s)
    s.requests = None if finished is None else int(round(finished))
    s.request_throughput = per_s(finished)
    s.prompt_throughput = per_s(d.counter(PROMPT_TOKENS))
    s.output_throughput = per_s(d.counter(GENERATION_TOKENS))
    s.ttft_ms = d.dist(names.TIME_TO_FIRST_TOKEN_SECONDS, 1000.0)
    s.queue_ms = d.dist(names.REQUEST_QUEUE_TIME_SECONDS, 1000.0)
    s.prefill_ms = d.dist(names.REQUEST_PREFILL_TIME_SECONDS, 1000.0)
    s.decode_ms = d.dist(names.REQUEST_DECODE_TIME_SECONDS, 1000.0)
    s.tpot_ms = d.dist(names.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS, 1000.0)
    s.itl_ms = d.dist(names.INTER_TOKEN_LATENCY_SECONDS, 1000.0)
    s.e2el_ms = d.dist(names.E2E_REQUEST_LATENCY_SECONDS, 1000.0)
    s.prompt_tokens = d.dist(names.REQUEST_PROMPT_TOKENS)
    s.output_tokens = d.dist(names.REQUEST_GENERATION_TOKENS)
    prefill_s, decode_s = d.sum(names.REQUEST_PREFILL_TIME_SECONDS), d.sum(names.REQUEST_DECODE_TIME_SECONDS)
    if prefill_s is None or decode_s is None:  # llama.cpp: seconds spent on prompts / on generation, all slots
        prefill_s, decode_s = d.counter(LLAMA_PROMPT_S), d.counter(LLAMA_PREDICTED_S)
    if prefill_s is not None and decode_s is not None and prefill_s + decode_s > 0:
        s.prefill_share = prefill_s / (prefill_s + decode_s)
    s.preemptions = d.counter(PREEMPTIONS)
    s.prefix_cache_queries = d.counter(PREFIX_QUERIES)
    s.prefix_cache_hit_rate = d.ratio(PREFIX_HITS, PREFIX_QUERIES)
    prompt = d.counter(PROMPT_TOKENS)
    if prompt is not None and prefill_s:
        s.prefill_tokens_per_s = prompt * (1.0 - (s.prefix_cache_hit_rate or 0.0)) / prefill_s
    s.spec_acceptance_rate = d.ratio(SPEC_ACCEPTED, SPEC_DRAFT)
    s.answer_cache_hit_rate = d.ratio(ANSWER_HITS, ANSWER_QUERIES)
    s.finish_reasons = {k: v - first.finish_reasons.get(k, 0.0) for k, v in w.last.finish_reasons.items()}
    s.resident_memory_bytes = w.last.samples.get(names.PROCESS_RESIDENT_MEMORY_BYTES)
    ttft_buckets = d.buckets(names.TIME_TO_FIRST_TOKEN_SECONDS) or []
    s.ttft_buckets = [[1000.0 * le, c - (ttft_buckets[i - 1][1] if i else 0.0)]
                      for i, (le, c) in enumerate(ttft_buckets)]
    _gauge_fields(s, w, traffic)
    identity = ("server_kind", "model", "max_model_len", "scope", "window_s", "origin", "unseen", "sources")
    s.origin = {name: "/metrics" for name in vars(s) if name not in identity and getattr(s, name) not in (None, [], {})}
    where = f"{window_s:.1f} s window" if scope == "window" else "since the server started (no traffic in window)"
    s.sources = [f"/metrics: {len(w.polls)} scrapes, counters {where}"]
    return fill_unseen(s)


def _gauge_fields(s: Snapshot, w: Window, traffic: bool) -> None:
    """Peaks of the polled gauges; their means, the KV series and the mean concurrency only from a window with
    traffic (an idle window's zeros say nothing of the load behind counters taken since the server started)."""
    kv = [(t, v) for t, v, _, _ in w.polls if v is not None]
    running = [v for _, _, v, _ in w.polls if v is not None]
    waiting = [v for _, _, _, v in w.polls if v is not None]
    if kv:
        s.kv_usage_peak = max(v for _, v in kv)
        if traffic or s.scope == "window":
            s.kv_usage_mean = sum(v for _, v in kv) / len(kv)
            s.kv_series = [[t, v] for t, v in kv]
    if running:
        s.running_peak = max(running)
        if traffic or s.scope == "window":
            s.running_mean = sum(running) / len(running)
        if traffic:
            s.mean_concurrency = s.running_mean
    if waiting:
        s.waiting_peak = max(waiting)
    busy = pick(w.last.samples, LLAMA_BUSY_SLOTS)
    if s.mean_concurrency is None and busy:
        s.mean_concurrency = busy  # llama.cpp's running mean of busy slots per decode call
