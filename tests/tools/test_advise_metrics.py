"""The advisor's inputs: Prometheus scrapes (leanserve's names and llama-server's), windows, histogram quantiles,
``leanserve bench`` result files and their merge, with exact expected numbers."""

from __future__ import annotations

import json
import math

from leanserve import metric_names as names
from leanserve.tools.advise_metrics import Window, histogram_quantile, parse_scrape, snapshot_from_window
from leanserve.tools.advise_snapshot import load_bench_runs, merge, snapshot_from_bench

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class FakeServer:
    """A registry with leanserve's metric names (as the server registers them), fed by hand."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        label = [names.MODEL_NAME_LABEL]
        self.kv = Gauge(names.KV_CACHE_USAGE_PERC, "kv", label, registry=r).labels("m")
        self.running = Gauge(names.NUM_REQUESTS_RUNNING, "r", label, registry=r).labels("m")
        self.waiting = Gauge(names.NUM_REQUESTS_WAITING, "w", label, registry=r).labels("m")
        self.counters = {n: Counter(n, n, label, registry=r).labels("m") for n in (
            names.PROMPT_TOKENS, names.GENERATION_TOKENS, names.NUM_PREEMPTIONS, names.PREFIX_CACHE_QUERIES,
            names.PREFIX_CACHE_HITS)}
        self.success = Counter(names.REQUEST_SUCCESS, "s", [names.MODEL_NAME_LABEL, names.FINISHED_REASON_LABEL],
                               registry=r)
        buckets = [0.1, 0.5, 1.0, 2.5, 5.0]
        self.hist = {n: Histogram(n, n, label, buckets=buckets, registry=r).labels("m") for n in names.HISTOGRAMS}

    def request(self, ttft: float, queue: float, prefill: float, decode: float, prompt: int, output: int,
                hits: int) -> None:
        h = self.hist
        for name, value in ((names.TIME_TO_FIRST_TOKEN_SECONDS, ttft), (names.REQUEST_QUEUE_TIME_SECONDS, queue),
                            (names.REQUEST_PREFILL_TIME_SECONDS, prefill), (names.REQUEST_DECODE_TIME_SECONDS, decode),
                            (names.E2E_REQUEST_LATENCY_SECONDS, ttft + decode),
                            (names.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS, decode / (output - 1)),
                            (names.REQUEST_PROMPT_TOKENS, prompt), (names.REQUEST_GENERATION_TOKENS, output)):
            h[name].observe(value)
        for _ in range(output - 1):
            h[names.INTER_TOKEN_LATENCY_SECONDS].observe(decode / (output - 1))
        self.counters[names.PROMPT_TOKENS].inc(prompt)
        self.counters[names.GENERATION_TOKENS].inc(output)
        self.counters[names.PREFIX_CACHE_QUERIES].inc(prompt)
        self.counters[names.PREFIX_CACHE_HITS].inc(hits)
        self.success.labels("m", "length").inc()

    def scrape(self, t: float):
        return parse_scrape(generate_latest(self.registry).decode(), t)


def test_histogram_quantile_interpolates_like_promql():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)]
    assert histogram_quantile(buckets, 0.1) == pytest.approx(0.05)  # rank 1 of 2 in [0, 0.1]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.4)  # rank 5: 0.1 + 0.4 * 3 / 4
    assert histogram_quantile(buckets, 0.99) == 1.0  # in +Inf: the largest finite bound
    assert histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5) is None


def test_histogram_quantile_stays_within_what_the_mean_allows():
    coarse = [(0.3, 10.0), (0.5, 10.0), (math.inf, 10.0)]  # 10 requests of ~1 ms, all under the first bound
    assert histogram_quantile(coarse, 0.5) == pytest.approx(0.15)  # PromQL's value: 150x the mean
    # at least half the observations are >= the median and none is < 0: median <= 2 x mean; p99 <= 100 x mean
    assert histogram_quantile(coarse, 0.5, mean=0.001) == pytest.approx(0.002)
    assert histogram_quantile(coarse, 0.99, mean=0.001) == pytest.approx(0.01)  # no one of 10 is over their sum
    # all near the top of (1, 2]: at least half are <= the median and none is > 2: median >= 2 - 0.01 / 0.5
    high = [(1.0, 0.0), (2.0, 10.0), (math.inf, 10.0)]
    assert histogram_quantile(high, 0.5) == pytest.approx(1.5)
    assert histogram_quantile(high, 0.5, mean=1.99) == pytest.approx(1.98)
    # a consistent histogram keeps its interpolated values; one observation is its mean
    spread = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)]
    assert histogram_quantile(spread, 0.5, mean=0.45) == pytest.approx(0.4)
    assert histogram_quantile([(0.3, 1.0), (math.inf, 1.0)], 0.99, mean=0.004) == 0.004
    # through a window: the advisor's p50 / p99 of a coarse histogram are not above what its mean allows
    srv = FakeServer()
    first = srv.scrape(0.0)
    for _ in range(4):
        srv.request(0.002, 0.001, 0.001, 0.02, prompt=10, output=3, hits=0)  # every TTFT in the 0.1 s bucket
    snap = snapshot_from_window(Window(first, srv.scrape(10.0)))
    assert snap.ttft_ms.mean == pytest.approx(2.0)
    # median <= 2 x mean; none of 4 observations of mean 2 ms exceeds their 8 ms sum (PromQL: 50 ms, 99 ms)
    assert snap.ttft_ms.p50 == pytest.approx(4.0) and snap.ttft_ms.p99 == pytest.approx(8.0)


def test_window_counts_only_what_happened_in_it():
    srv = FakeServer()
    srv.request(0.3, 0.05, 0.25, 2.0, prompt=200, output=41, hits=100)  # before the window: not counted
    first = srv.scrape(100.0)
    srv.kv.set(0.5)
    srv.running.set(2)
    srv.waiting.set(1)
    mid = srv.scrape(105.0)
    srv.request(0.8, 0.6, 0.2, 3.0, prompt=1000, output=101, hits=0)
    srv.request(1.2, 0.9, 0.3, 1.0, prompt=600, output=21, hits=300)
    srv.counters[names.NUM_PREEMPTIONS].inc(2)
    srv.kv.set(0.25)
    srv.running.set(0)
    srv.waiting.set(0)
    last = srv.scrape(110.0)
    w = Window(first, last, [(0.0, 0.0, 0.0, 0.0), (5.0, 0.5, 2.0, 1.0), (10.0, 0.25, 0.0, 0.0)])
    assert mid.samples[names.KV_CACHE_USAGE_PERC] == 0.5
    s = snapshot_from_window(w, "leanserve", "m", 8192)
    assert (s.server_kind, s.scope, s.window_s, s.requests) == ("leanserve", "window", 10.0, 2)
    assert s.request_throughput == pytest.approx(0.2) and s.prompt_throughput == pytest.approx(160.0)
    assert s.output_throughput == pytest.approx(12.2)
    assert s.ttft_ms.mean == pytest.approx(1000.0) and s.ttft_ms.count == 2 and not s.ttft_ms.exact
    assert s.queue_ms.mean == pytest.approx(750.0) and s.prefill_ms.mean == pytest.approx(250.0)
    assert s.prompt_tokens.mean == pytest.approx(800.0) and s.output_tokens.mean == pytest.approx(61.0)
    assert s.ttft_ms.p50 == pytest.approx(1000.0)  # rank 1 of 2: the top of the (0.5, 1.0] bucket
    assert s.prefill_share == pytest.approx(0.5 / 4.5)
    assert s.prefix_cache_hit_rate == pytest.approx(300 / 1600) and s.preemptions == 2
    assert s.prefill_tokens_per_s == pytest.approx(1600 * (1 - 300 / 1600) / 0.5)
    assert (s.kv_usage_peak, s.running_peak, s.waiting_peak) == (0.5, 2.0, 1.0)
    assert s.kv_usage_mean == pytest.approx(0.25) and s.mean_concurrency == pytest.approx(2 / 3)
    assert s.finish_reasons == {"length": 2.0}
    assert [c for _, c in s.ttft_buckets] == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert s.origin["ttft_ms"] == "/metrics" and s.spec_acceptance_rate is None
    assert ["speculative acceptance rate", "vllm:spec_decode_num_*_tokens_total (no speculation)"] in s.unseen


def test_idle_window_falls_back_on_counters_since_start():
    srv = FakeServer()
    srv.request(0.3, 0.05, 0.25, 2.0, prompt=200, output=41, hits=100)
    s = snapshot_from_window(Window(srv.scrape(0.0), srv.scrape(5.0), [(0.0, 0.0, 0.0, 0.0)]), "leanserve")
    assert s.scope == "since start" and s.window_s is None and s.requests == 1
    assert s.request_throughput is None and s.output_throughput is None  # no window to divide by
    assert s.ttft_ms.mean == pytest.approx(300.0) and s.prefix_cache_hit_rate == pytest.approx(0.5)
    assert s.mean_concurrency is None and s.kv_usage_mean is None  # idle gauges say nothing of the past load
    assert s.kv_usage_peak == 0.0 and s.kv_series == []


def test_fresh_idle_server_has_empty_distributions_not_missing_ones():
    srv = FakeServer()
    s = snapshot_from_window(Window(srv.scrape(0.0), srv.scrape(5.0)), "leanserve")
    assert s.scope == "window" and s.requests == 0 and s.ttft_ms.count == 0 and s.ttft_ms.mean is None
    assert "TTFT distribution" not in [what for what, _ in s.unseen]


LLAMA = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {prompt}
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total {prompt_s}
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {pred}
# HELP llamacpp:tokens_predicted_seconds_total Predict process time
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total {pred_s}
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 120
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 2.5
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 190.5
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 28.1
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {processing}
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred {deferred}
"""


def test_llama_server_metrics_give_what_they_have():
    first = parse_scrape(LLAMA.format(prompt=1000, prompt_s=5.0, pred=400, pred_s=10.0, processing=0, deferred=0))
    last = parse_scrape(LLAMA.format(prompt=4000, prompt_s=20.0, pred=900, pred_s=30.0, processing=4, deferred=2),
                        10.0)
    polls = [(0.0, None, 0.0, 0.0), (10.0, None, 4.0, 2.0)]
    s = snapshot_from_window(Window(first, last, polls), "llamacpp")
    assert s.server_kind == "llama.cpp" and s.scope == "window"
    assert s.prompt_throughput == pytest.approx(300.0) and s.output_throughput == pytest.approx(50.0)
    assert s.prefill_share == pytest.approx(15 / 35) and s.prefill_tokens_per_s == pytest.approx(200.0)
    assert (s.running_peak, s.waiting_peak) == (4.0, 2.0)
    assert s.ttft_ms is None and s.requests is None and s.preemptions is None and s.kv_usage_peak is None
    blind = [what for what, _ in s.unseen]
    for what in ("TTFT distribution", "queue time", "TPOT", "finished requests", "KV-cache usage", "preemptions",
                 "prefix-cache hit rate", "prompt length distribution"):
        assert what in blind


def bench_run(rate: float | str = 2.0) -> dict:
    """A bench result dict (RunResult.to_dict's fields that the advisor reads): 4 requests, one failed."""
    return {"model_id": "m", "request_rate": rate, "duration": 8.0, "completed": 3, "failed": 1,
            "total_input_tokens": 900, "total_output_tokens": 120,
            "median_ttft_ms": 400.0, "p99_ttft_ms": 596.0,
            "ttfts": [0.2, 0.4, 0.6, 0.0], "e2els": [2.2, 1.4, 4.6, 0.0], "output_lens": [41, 11, 68, 0],
            "input_lens": [300, 200, 400, 0], "itls": [[0.05] * 40, [0.1] * 10, [0.0588] * 67, []],
            "start_times": [0, 1, 2, 3], "errors": ["", "", "", "HTTP 503"],
            "server_metrics": {"peak_kv_cache_usage_perc": 0.3, "peak_num_requests_running": 3,
                               "peak_num_requests_waiting": 1, "num_preemptions": 0, "prefix_cache_hit_rate": 0.4,
                               "mean_queue_time_ms": 120.0, "num_scrapes": 10}}


def test_bench_results_give_exact_client_side_numbers(tmp_path):
    run = bench_run()
    single, sweep = tmp_path / "run.json", tmp_path / "sweep.json"
    single.write_text(json.dumps(run))
    sweep.write_text(json.dumps({"label": "x", "runs": [run, bench_run(4.0)]}))
    runs = load_bench_runs([single])
    s = snapshot_from_bench(runs)
    assert s.scope == "bench" and s.requests == 3 and s.request_throughput == pytest.approx(3 / 8)
    assert s.ttft_ms.p50 == pytest.approx(run["median_ttft_ms"]) and s.ttft_ms.p99 == pytest.approx(run["p99_ttft_ms"])
    assert s.ttft_ms.exact and s.ttft_samples_ms == pytest.approx([200.0, 400.0, 600.0])
    assert s.tpot_ms.mean == pytest.approx(1000 * np.mean([2.0 / 40, 1.0 / 10, 4.0 / 67]))
    assert s.prompt_tokens.mean == 300 and s.output_tokens.p50 == 41
    assert s.mean_concurrency == pytest.approx(8.2 / 8)  # Little's law: summed latencies / duration
    assert s.queue_ms.mean == 120.0 and s.kv_usage_peak == 0.3 and s.prefix_cache_hit_rate == 0.4
    both = snapshot_from_bench(load_bench_runs([sweep]))
    assert both.requests == 6 and both.request_throughput == pytest.approx(6 / 16)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a `leanserve bench"):
        load_bench_runs([tmp_path / "bad.json"])


def test_merge_takes_client_numbers_from_bench_and_server_numbers_from_metrics():
    srv = FakeServer()
    srv.request(0.9, 0.5, 0.4, 2.0, prompt=300, output=41, hits=0)
    live = snapshot_from_window(Window(srv.scrape(0.0), srv.scrape(5.0), [(0.0, 0.6, 1.0, 4.0)]), "leanserve")
    bench = snapshot_from_bench([bench_run()])
    s = merge(live, bench)
    assert s.server_kind == "leanserve" and s.scope == "since start"
    assert s.ttft_ms.p50 == pytest.approx(400.0) and s.origin["ttft_ms"] == "bench"  # what users felt
    assert s.queue_ms.mean == pytest.approx(500.0) and s.origin["queue_ms"] == "/metrics"  # the server's own
    assert s.prefix_cache_hit_rate == 0.0 and s.origin["prefix_cache_hit_rate"] == "/metrics"
    assert (s.kv_usage_peak, s.running_peak, s.waiting_peak) == (0.6, 3, 4.0)  # the larger of each peak
    assert s.sources[0].startswith("/metrics") and s.sources[1].startswith("bench")
