"""Scraping the server's Prometheus metrics: deltas, peaks, prefix-cache hit rate, mean queue time; and the bench
reading what leanserve's own ServerMetrics writes, for every name the two share."""

from __future__ import annotations

import asyncio

from leanserve.bench import server_metrics as bench
from leanserve.bench.server_metrics import MetricsPoller, parse_samples, pick
from leanserve.engine.async_engine import AsyncEngineStats
from leanserve.engine.llm_engine import EngineStats
from leanserve.entrypoints.openai.metrics import ServerMetrics
from leanserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

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


class FakeEngine:
    """The stats snapshot a ServerMetrics reads at scrape time, set by the test."""

    def __init__(self) -> None:
        self.set(running=0, waiting=0, kv=0.0, preemptions=0, queries=0, hits=0)

    def set(self, *, running: int, waiting: int, kv: float, preemptions: int, queries: int, hits: int,
            drafts: int = 0, draft_tokens: int = 0, accepted: int = 0) -> None:
        e = EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=kv, num_blocks=16,
                        num_free_blocks=16 - round(16 * kv), prefix_cache_queries=queries, prefix_cache_hits=hits,
                        num_preemptions=preemptions, spec_num_drafts=drafts, spec_num_draft_tokens=draft_tokens,
                        spec_num_accepted_tokens=accepted)
        self.stats = AsyncEngineStats(e, waiting, running, kv)

    def snapshot(self) -> AsyncEngineStats:
        return self.stats


def finish(metrics: ServerMetrics, engine: FakeEngine, rid: str, queue_time: float) -> None:
    """One request of two tokens that waited ``queue_time`` seconds before its first scheduling, stepped to its end."""
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=queue_time, first_token_time=queue_time + 0.5,
                       last_token_time=queue_time + 1.0, finished_time=queue_time + 1.0, num_generation_tokens=2)
    choice = CompletionOutput(index=0, token_ids=[7, 8], finish_reason="stop", metrics=m)
    metrics.on_step([RequestOutput(rid, None, [1, 2, 3], [choice], finished=True, metrics=m)], engine.stats.engine)


# What the bench reads (each of its tuples of sample names) -> the field of FakeEngine.set / the queue-time total
# it must come back as. A new tuple in leanserve.bench.server_metrics must be added here.
SHARED = {"KV_USAGE": "kv", "RUNNING": "running", "WAITING": "waiting", "PREEMPTIONS": "preemptions",
          "PREFIX_QUERIES": "queries", "PREFIX_HITS": "hits", "QUEUE_SUM": "queue_sum", "QUEUE_COUNT": "queue_count",
          "SPEC_DRAFTS": "drafts", "SPEC_DRAFT_TOKENS": "draft_tokens", "SPEC_ACCEPTED": "accepted"}


def test_bench_reads_every_shared_metric_as_the_server_writes_it():
    read = {k for k, v in vars(bench).items() if k.isupper() and isinstance(v, tuple)}
    assert read == set(SHARED)
    engine = FakeEngine()
    values = dict(running=3, waiting=5, kv=0.375, preemptions=7, queries=96, hits=40, drafts=9, draft_tokens=30,
                  accepted=17)
    engine.set(**values)
    metrics = ServerMetrics("m", engine.snapshot, 512)
    for i, q in enumerate((0.25, 0.75, 1.5)):
        finish(metrics, engine, f"r{i}", q)
    values.update(queue_sum=2.5, queue_count=3)
    samples = parse_samples(metrics.render().decode())
    for attr, field in SHARED.items():
        sample_names = getattr(bench, attr)
        assert sample_names[0] in samples, attr  # leanserve's own name, not a peer server's alias
        assert not any(alias in samples for alias in sample_names[1:]), attr
        assert pick(samples, sample_names) == pytest.approx(values[field]), attr


def test_report_from_a_live_server_metrics():
    engine = FakeEngine()
    metrics = ServerMetrics("m", engine.snapshot, 512)
    finish(metrics, engine, "old", 9.0)  # finished before the run: not in the mean queue time

    def during_run() -> None:
        engine.set(running=0, waiting=1, kv=0.25, preemptions=5, queries=250, hits=110, drafts=12, draft_tokens=40,
                   accepted=30)
        finish(metrics, engine, "a", 0.25)
        finish(metrics, engine, "b", 0.75)

    # each scrape first moves the engine to its next state: before, during, after the run
    states = [lambda: engine.set(running=1, waiting=0, kv=0.125, preemptions=2, queries=50, hits=10),
              lambda: engine.set(running=4, waiting=6, kv=0.625, preemptions=3, queries=150, hits=40),
              during_run]

    async def handler(request: httpx.Request) -> httpx.Response:
        states.pop(0)()
        return httpx.Response(200, content=metrics.render())

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test") as client:
            poller = MetricsPoller(client, interval_s=100.0)
            await poller.start()
            await poller.scrape()
            return await poller.stop()

    report = asyncio.run(main())
    assert report.peak_kv_cache_usage_perc == pytest.approx(0.625)
    assert report.peak_num_requests_running == 4 and report.peak_num_requests_waiting == 6
    assert report.num_preemptions == 3
    assert report.prefix_cache_hit_rate == pytest.approx(100 / 200)
    assert report.mean_queue_time_ms == pytest.approx(500.0)
    assert report.spec_acceptance_rate == pytest.approx(30 / 40)  # 0 before the run
    assert report.spec_mean_acceptance_length == pytest.approx(1 + 30 / 12)
    assert report.num_scrapes == 3
