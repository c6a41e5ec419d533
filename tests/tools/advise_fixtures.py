"""Synthetic snapshots for the advisor's tests: a healthy leanserve server under light load, changed per situation."""

from __future__ import annotations

from leanserve.tools.advise_snapshot import Dist, Snapshot, fill_unseen


def dist(mean: float, p50: float | None = None, p99: float | None = None, count: int = 20) -> Dist:
    """A distribution with the given mean (p50 / p99 default to it)."""
    return Dist(mean, mean if p50 is None else p50, mean if p99 is None else p99, count)


def healthy(**changes) -> Snapshot:
    """20 short chat requests over 30 s on leanserve: TTFT ~0.4 s, TPOT 25 ms, KV 20%, 40% prefix hits."""
    s = Snapshot(
        server_kind="leanserve", model="SmolLM2-135M-Instruct.Q4_1", max_model_len=8192, scope="window",
        window_s=30.0, requests=20, request_throughput=0.67, prompt_throughput=200.0, output_throughput=33.0,
        ttft_ms=dist(400, 350, 900), queue_ms=dist(20), prefill_ms=dist(380), decode_ms=dist(1200),
        tpot_ms=dist(25, 24, 40), itl_ms=dist(25, 24, 60, count=1000), e2el_ms=dist(1600),
        prompt_tokens=dist(300, 290, 480), output_tokens=dist(50, 48, 79), prefill_share=0.24,
        prefill_tokens_per_s=600.0, kv_usage_peak=0.2, kv_usage_mean=0.1, running_peak=3, running_mean=1.2,
        waiting_peak=0, mean_concurrency=1.2, preemptions=0, prefix_cache_hit_rate=0.4, prefix_cache_queries=6000,
        sources=["synthetic"])
    for name, value in changes.items():
        assert hasattr(s, name), name
        setattr(s, name, value)
    return fill_unseen(s)
