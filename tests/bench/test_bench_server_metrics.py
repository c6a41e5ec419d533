"""Scraping the server's Prometheus metrics: deltas, peaks, prefix-cache hit rate, mean queue time."""

from __future__ import annotations

import asyncio

from leanserve.bench.server_metrics import MetricsPoller, parse_samples

import httpx
import pytest


def exposition(kv: float, preemptions: float, queries: float, hits: float, qsum: float, qcount: float) -> str:
    return f"""# HELP vllm:kv_cache_usage_perc KV cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="m"}} {kv}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} {10 * kv}
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{model_name="m"}} {preemptions}
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{model_name="m"}} {queries}
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{model_name="m"}} {hits}
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{{le="1.0",model_name="m"}} {qcount}
vllm:request_queue_time_seconds_bucket{{le="+Inf",model_name="m"}} {qcount}
vllm:request_queue_time_seconds_count{{model_name="m"}} {qcount}
vllm:request_queue_time_seconds_sum{{model_name="m"}} {qsum}
"""


def test_parse_samples_sums_label_sets_and_skips_buckets():
    text = exposition(0.5, 1, 2, 3, 4, 5) + 'vllm:request_success_total{finished_reason="stop"} 2\n' \
        'vllm:request_success_total{finished_reason="length"} 3\n'
    s = parse_samples(text)
    assert s["vllm:kv_cache_usage_perc"] == 0.5
    assert s["vllm:num_preemptions_total"] == 1
    assert s["vllm:request_queue_time_seconds_sum"] == 4
    assert s["vllm:request_success_total"] == 5
    assert not any(k.endswith("_bucket") for k in s)


def _poll(pages: list[tuple[int, str]]):
    pages = list(pages)

    async def handler(request: httpx.Request) -> httpx.Response:
        status, text = pages.pop(0) if len(pages) > 1 else pages[0]
        return httpx.Response(status, text=text)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test") as client:
            poller = MetricsPoller(client, interval_s=100.0)
            await poller.start()  # 'before'
            await poller.scrape()  # one poll during the run
            return await poller.stop()  # 'after'
    return asyncio.run(main())


def test_report_from_before_during_after():
    report = _poll([(200, exposition(0.1, 1, 100, 20, 1.0, 2)), (200, exposition(0.7, 2, 200, 50, 2.0, 3)),
                    (200, exposition(0.05, 4, 300, 120, 4.0, 5))])
    assert report.peak_kv_cache_usage_perc == pytest.approx(0.7)
    assert report.peak_num_requests_running == pytest.approx(7.0)
    assert report.peak_num_requests_waiting is None  # not exported here
    assert report.num_preemptions == 3
    assert report.prefix_cache_hit_rate == pytest.approx(100 / 200)
    assert report.mean_queue_time_ms == pytest.approx(1000.0 * 3.0 / 3)
    assert report.num_scrapes == 3


def test_no_metrics_endpoint_gives_no_report():
    assert _poll([(404, "not found")]) is None
