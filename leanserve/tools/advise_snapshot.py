"""The numbers ``leanserve advise`` reasons on: one :class:`Snapshot` of the seed's metrics (its section 9: TTFT
and its parts, TPOT / ITL, throughput, memory / KV cache, queue time), built from a server's ``/metrics``
(:mod:`leanserve.tools.advise_metrics`) and/or ``leanserve bench`` result files (:func:`snapshot_from_bench`), and
:func:`merge` of the two.

Contract: every field is None when no source could see it (never a made-up 0); a :class:`Dist` with ``count == 0``
means "exported, but no request finished". Latencies are in milliseconds, throughputs per second, shares and
rates in 0..1. ``origin`` names where each group of numbers came from ("/metrics" or "bench"), ``unseen`` what
could not be seen and which metric would have shown it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Dist:
    """A distribution: mean, median and 99th percentile, and how many observations it has.

    ``exact``: computed from per-request values (numpy's linear percentiles, as ``leanserve bench``); False:
    interpolated inside Prometheus histogram buckets (as PromQL's ``histogram_quantile``), so only as fine as the
    buckets. ``p50`` / ``p99`` may be None where only a mean is known (bench's mean queue time).
    """

    mean: float | None
    p50: float | None
    p99: float | None
    count: int
    exact: bool = True

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        """The exact distribution of ``values`` (mean / p50 / p99 None when empty)."""
        a = np.asarray(values, dtype=float)
        if a.size == 0:
            return cls(None, None, None, 0)
        return cls(float(a.mean()), float(np.median(a)), float(np.percentile(a, 99)), int(a.size))


@dataclass
class Snapshot:
    """The seed's metrics for one server over one window (or since it started, or over benchmark runs).

    Attributes:
        server_kind: "leanserve", "vllm", "llama.cpp", "unknown" (metrics of another engine) or "none" (no /metrics).
        model / max_model_len: from ``GET /v1/models`` (or the bench JSON's model id).
        scope: "window" (counters' deltas over ``window_s`` seconds), "since start" (no traffic in the window:
            cumulative counters), "bench" (result files only), or "none".
        window_s: seconds the counters' deltas span (None outside "window").
        requests: finished requests.
        request_throughput / prompt_throughput / output_throughput: requests/s, prompt tokens/s, output tokens/s.
        ttft_ms / queue_ms / prefill_ms / decode_ms / tpot_ms / itl_ms / e2el_ms: per-request latencies (ITL: per
            token gap); queue + prefill = TTFT, measured by the server (queue from arrival to first scheduling).
        prompt_tokens / output_tokens: per-request lengths in tokens.
        prefill_share: time requests spent in prefill / (prefill + decode), 0..1.
        prefill_tokens_per_s: computed prompt tokens (prefix-cache hits excluded) per second of a request's prefill.
        kv_usage_peak / kv_usage_mean: KV-cache usage, 0..1; kv_series: ``[[seconds, usage], ...]`` polled.
        running_peak / running_mean / waiting_peak: the running and waiting gauges (sequences).
        mean_concurrency: mean requests in flight (polled gauge, or Little's law over a bench run).
        preemptions: preemptions counted (window / since start / bench runs).
        prefix_cache_hit_rate: prompt tokens found in the prefix cache / looked up; prefix_cache_queries: tokens.
        spec_acceptance_rate: accepted / proposed speculative tokens; answer_cache_hit_rate: hits / queries.
        finish_reasons: finished requests by reason.
        resident_memory_bytes: the server process's resident memory.
        ttft_buckets: ``[[upper bound ms, count]]`` of the TTFT histogram (non-cumulative), for the report's plot;
            ttft_samples_ms: per-request TTFTs (bench), for the same plot.
        origin: metric group -> "/metrics" or "bench". unseen: ``[what, why]`` pairs. sources: what was read.
    """

    server_kind: str = "none"
    model: str | None = None
    max_model_len: int | None = None
    scope: str = "none"
    window_s: float | None = None
    requests: int | None = None
    request_throughput: float | None = None
    prompt_throughput: float | None = None
    output_throughput: float | None = None
    ttft_ms: Dist | None = None
    queue_ms: Dist | None = None
    prefill_ms: Dist | None = None
    decode_ms: Dist | None = None
    tpot_ms: Dist | None = None
    itl_ms: Dist | None = None
    e2el_ms: Dist | None = None
    prompt_tokens: Dist | None = None
    output_tokens: Dist | None = None
    prefill_share: float | None = None
    prefill_tokens_per_s: float | None = None
    kv_usage_peak: float | None = None
    kv_usage_mean: float | None = None
    kv_series: list[list[float]] = field(default_factory=list)
    running_peak: float | None = None
    running_mean: float | None = None
    waiting_peak: float | None = None
    mean_concurrency: float | None = None
    preemptions: float | None = None
    prefix_cache_hit_rate: float | None = None
    prefix_cache_queries: float | None = None
    spec_acceptance_rate: float | None = None
    answer_cache_hit_rate: float | None = None
    finish_reasons: dict[str, float] = field(default_factory=dict)
    resident_memory_bytes: float | None = None
    ttft_buckets: list[list[float]] = field(default_factory=list)
    ttft_samples_ms: list[float] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)
    unseen: list[list[str]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    @property
    def queue_share_of_ttft(self) -> float | None:
        """Mean queue time / mean TTFT (0..1, capped at 1), or None when either is unknown."""
        q = self.queue_ms.mean if self.queue_ms else None
        t = self.ttft_ms.mean if self.ttft_ms else None
        return None if q is None or not t else min(1.0, q / t)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (Dists as dicts), plus ``queue_share_of_ttft``."""
        d = asdict(self)
        d["queue_share_of_ttft"] = self.queue_share_of_ttft
        return d


# Where each quantity comes from, for the "cannot see" list: field -> (what, the metric or file that shows it).
NEEDS: tuple[tuple[str, str, str], ...] = (
    ("ttft_ms", "TTFT distribution", "vllm:time_to_first_token_seconds, or --bench-json"),
    ("queue_ms", "queue time", "vllm:request_queue_time_seconds"),
    ("prefill_ms", "prefill time per request", "vllm:request_prefill_time_seconds"),
    ("decode_ms", "decode time per request", "vllm:request_decode_time_seconds"),
    ("tpot_ms", "TPOT", "vllm:request_time_per_output_token_seconds, or --bench-json"),
    ("itl_ms", "inter-token latency", "vllm:inter_token_latency_seconds, or --bench-json"),
    ("requests", "finished requests", "vllm:e2e_request_latency_seconds, or --bench-json"),
    ("request_throughput", "request throughput", "traffic during --duration, or --bench-json"),
    ("output_throughput", "token throughput", "traffic during --duration, or --bench-json"),
    ("prompt_tokens", "prompt length distribution", "vllm:request_prompt_tokens, or --bench-json"),
    ("output_tokens", "output length distribution", "vllm:request_generation_tokens, or --bench-json"),
    ("prefill_share", "share of time in prefill vs decode", "vllm:request_prefill/decode_time_seconds"),
    ("kv_usage_peak", "KV-cache usage", "vllm:kv_cache_usage_perc"),
    ("waiting_peak", "waiting requests", "vllm:num_requests_waiting"),
    ("mean_concurrency", "requests in flight", "vllm:num_requests_running during traffic, or --bench-json"),
    ("preemptions", "preemptions", "vllm:num_preemptions_total"),
    ("prefix_cache_hit_rate", "prefix-cache hit rate", "vllm:prefix_cache_queries/hits_total"),
    ("spec_acceptance_rate", "speculative acceptance rate", "vllm:spec_decode_num_*_tokens_total (no speculation)"),
    ("answer_cache_hit_rate", "answer-cache hit rate", "leanserve:answer_cache_*_total (no answer cache)"),
)


def fill_unseen(s: Snapshot) -> Snapshot:
    """Set ``s.unseen`` to the ``[what, shown by]`` pairs of :data:`NEEDS` whose field is None. Returns ``s``."""
    s.unseen = [[what, metric] for name, what, metric in NEEDS if getattr(s, name) is None]
    return s


# ------------------------------------------------------------------------------------------- bench result files
def load_bench_runs(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """The run dicts of ``leanserve bench --result-json`` files: a single run, or a sweep's ``runs``.

    Raises:
        OSError: a file cannot be read. ValueError: a file is not JSON or holds no bench run.
    """
    runs: list[dict[str, Any]] = []
    for path in paths:
        try:
            payload = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
        found = payload.get("runs", [payload]) if isinstance(payload, dict) else []
        found = [r for r in found if isinstance(r, dict) and "ttfts" in r and "duration" in r]
        if not found:
            raise ValueError(f"{path}: not a `leanserve bench --result-json` file (no run with ttfts)")
        runs.extend(found)
    return runs


def _weighted(pairs: Iterable[tuple[float | None, float]]) -> float | None:
    pairs = [(v, w) for v, w in pairs if v is not None and w > 0]
    total = sum(w for _, w in pairs)
    return None if not pairs or total == 0 else sum(v * w for v, w in pairs) / total


def snapshot_from_bench(runs: Sequence[dict[str, Any]]) -> Snapshot:
    """A :class:`Snapshot` of ``leanserve bench`` runs taken together (the per-request lists concatenated; the
    throughputs over the summed durations; the server's view: peaks as maxima, preemptions summed, prefix-cache
    hit rate weighted by input tokens, mean queue time by completed requests).

    For one run the TTFT / TPOT / ITL / E2EL percentiles equal the run's own ``median_*_ms`` / ``p99_*_ms``.
    """
    ok = [(r, i) for r in runs for i, e in enumerate(r["errors"]) if not e]
    duration = sum(float(r["duration"]) for r in runs)
    ttft = [r["ttfts"][i] for r, i in ok]
    e2el = [r["e2els"][i] for r, i in ok]
    outs = [r["output_lens"][i] for r, i in ok]
    tpot = [(e - t) / (n - 1) for t, e, n in zip(ttft, e2el, outs, strict=True) if n > 1]
    itl = [g for r, i in ok for g in r["itls"][i]]
    servers = [r["server_metrics"] for r in runs if r.get("server_metrics")]

    def ms(values: Sequence[float]) -> Dist:
        return Dist.of(np.asarray(values, dtype=float) * 1000.0)

    def peak(key: str) -> float | None:
        values = [m[key] for m in servers if m.get(key) is not None]
        return max(values) if values else None

    completed = sum(int(r["completed"]) for r in runs)
    s = Snapshot(
        server_kind="unknown", model=runs[0].get("model_id") if runs else None, scope="bench",
        requests=completed,
        request_throughput=completed / duration if duration > 0 else None,
        prompt_throughput=sum(r["total_input_tokens"] for r in runs) / duration if duration > 0 else None,
        output_throughput=sum(r["total_output_tokens"] for r in runs) / duration if duration > 0 else None,
        ttft_ms=ms(ttft), tpot_ms=ms(tpot), itl_ms=ms(itl), e2el_ms=ms(e2el),
        prompt_tokens=Dist.of([r["input_lens"][i] for r, i in ok]), output_tokens=Dist.of(outs),
        mean_concurrency=sum(e2el) / duration if duration > 0 else None,
        kv_usage_peak=peak("peak_kv_cache_usage_perc"), running_peak=peak("peak_num_requests_running"),
        waiting_peak=peak("peak_num_requests_waiting"),
        preemptions=(sum(m["num_preemptions"] for m in servers if m.get("num_preemptions") is not None)
                     if any(m.get("num_preemptions") is not None for m in servers) else None),
        prefix_cache_hit_rate=_weighted((m.get("prefix_cache_hit_rate"), r["total_input_tokens"])
                                        for r in runs if (m := r.get("server_metrics"))),
        ttft_samples_ms=[1000.0 * t for t in ttft],
        sources=[f"bench: {len(runs)} run(s), {completed} requests, {duration:.1f} s"])
    s.spec_acceptance_rate = _weighted((m.get("spec_acceptance_rate"), r["total_output_tokens"])
                                       for r in runs if (m := r.get("server_metrics")))
    queue = _weighted((m.get("mean_queue_time_ms"), r["completed"]) for r in runs if (m := r.get("server_metrics")))
    if queue is not None:
        s.queue_ms = Dist(queue, None, None, completed)
    s.origin = {name: "bench" for name in _CLIENT_FIELDS + _SERVER_FIELDS if getattr(s, name) is not None}
    return s


# Fields best measured by the client (what users feel, exact per request) and by the server (its own view).
_CLIENT_FIELDS = ("requests", "request_throughput", "prompt_throughput", "output_throughput", "ttft_ms", "tpot_ms",
                  "itl_ms", "e2el_ms", "prompt_tokens", "output_tokens", "mean_concurrency", "ttft_samples_ms")
_SERVER_FIELDS = ("queue_ms", "prefill_ms", "decode_ms", "prefill_share", "prefill_tokens_per_s", "kv_usage_mean",
                  "kv_series", "running_mean", "preemptions", "prefix_cache_hit_rate", "prefix_cache_queries",
                  "spec_acceptance_rate", "answer_cache_hit_rate", "finish_reasons", "resident_memory_bytes",
                  "ttft_buckets")
_PEAK_FIELDS = ("kv_usage_peak", "running_peak", "waiting_peak")


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, list | dict) and not value)


def merge(live: Snapshot | None, bench: Snapshot | None) -> Snapshot:
    """One snapshot of both: client-side quantities (latencies users feel, throughputs, lengths) from ``bench``
    where it has them, server-side ones (queue / prefill / decode split, KV, preemptions, caches) from ``live``
    where it has them, each falling back on the other; peaks are the larger of the two. ``origin`` records the
    choice. Identity, model and scope come from ``live`` (the server), else ``bench``."""
    if live is None or bench is None:
        return fill_unseen(live or bench or Snapshot())
    out = Snapshot(**{f.name: getattr(live, f.name) for f in fields(Snapshot)})
    out.model = live.model or bench.model
    origin = dict(live.origin)
    for names, first, second in ((_CLIENT_FIELDS, bench, live), (_SERVER_FIELDS, live, bench)):
        for name in names:
            chosen = first if not _empty(getattr(first, name)) else second
            setattr(out, name, getattr(chosen, name))
            if not _empty(getattr(chosen, name)):
                origin[name] = chosen.origin.get(name, "bench" if chosen is bench else "/metrics")
    for name in _PEAK_FIELDS:
        values = [v for v in (getattr(live, name), getattr(bench, name)) if v is not None]
        setattr(out, name, max(values) if values else None)
    out.sources = live.sources + bench.sources
    out.origin = origin
    return fill_unseen(out)
