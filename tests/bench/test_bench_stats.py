"""Benchmark statistics on hand-made timings with known answers."""

from __future__ import annotations

from leanserve.bench.client import RequestResult
from leanserve.bench.stats import (
    compute_metrics,
    is_good,
    max_concurrency_seen,
    max_sustained_rate,
    parse_goodput,
    percentile_name,
    tpot,
)

import pytest


def results() -> list[RequestResult]:
    """Three successful requests and one failure (times in seconds)."""
    return [
        RequestResult(success=True, prompt_tokens=100, output_tokens=10, ttft=0.55, itl=[0.05] * 9, latency=1.0,
                      start=0.0),
        RequestResult(success=True, prompt_tokens=200, output_tokens=5, ttft=0.3, itl=[0.5] * 4, latency=2.3,
                      start=0.5),
        RequestResult(success=True, prompt_tokens=300, output_tokens=1, ttft=0.2, itl=[], latency=0.2, start=1.5),
        RequestResult(success=False, prompt_tokens=50, output_tokens=0, latency=0.1, start=0.6, error="HTTP 503"),
    ]


def test_tpot_excludes_the_first_token():
    r = results()
    assert tpot(r[0]) == pytest.approx(0.45 / 9)  # (1.0 - 0.55) / (10 - 1), not 1.0 / 10
    assert tpot(r[1]) == pytest.approx(0.5)
    assert tpot(r[2]) is None  # one output token: no TPOT


def test_counts_and_throughputs():
    m = compute_metrics(results(), duration=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (600, 16)  # the failed request's 50 are not counted
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(8.0)
    assert m.total_token_throughput == pytest.approx(308.0)
    assert m.request_goodput is None
    assert m.max_concurrent_requests == 3  # at 0.6-0.7 s: requests 1, 2 and 4


def test_latency_percentiles():
    lat = compute_metrics(results(), duration=2.0).latency
    # TTFT sample [550, 300, 200] ms; linear interpolation on sorted [200, 300, 550]
    assert lat["mean_ttft_ms"] == pytest.approx(350.0)
    assert lat["median_ttft_ms"] == pytest.approx(300.0)
    assert lat["p50_ttft_ms"] == pytest.approx(300.0)
    assert lat["p90_ttft_ms"] == pytest.approx(500.0)
    assert lat["p99_ttft_ms"] == pytest.approx(545.0)
    # TPOT sample [50, 500] ms
    assert lat["mean_tpot_ms"] == pytest.approx(275.0)
    assert lat["p99_tpot_ms"] == pytest.approx(495.5)
    assert lat["std_tpot_ms"] == pytest.approx(225.0)
    # ITL: every gap of the successful requests: 9 x 50 ms and 4 x 500 ms
    assert lat["mean_itl_ms"] == pytest.approx((9 * 50 + 4 * 500) / 13)
    assert lat["median_itl_ms"] == pytest.approx(50.0)
    # E2EL sample [1000, 2300, 200] ms
    assert lat["mean_e2el_ms"] == pytest.approx(3500 / 3)
    assert lat["median_e2el_ms"] == pytest.approx(1000.0)


def test_goodput_under_slos():
    r = results()
    assert compute_metrics(r, 2.0, {"ttft": 400, "tpot": 200}).request_goodput == pytest.approx(0.5)  # only r3
    assert compute_metrics(r, 2.0, {"ttft": 600, "tpot": 600}).request_goodput == pytest.approx(1.5)  # all three
    assert compute_metrics(r, 2.0, {"e2el": 1500}).request_goodput == pytest.approx(1.0)  # r1 and r3
    # attainment divides by every sent request (4, one failed), not by the duration
    assert compute_metrics(r, 2.0, {"e2el": 1500}).slo_attainment == pytest.approx(0.5)
    assert compute_metrics(r, 2.0, {"ttft": 400, "tpot": 200}).slo_attainment == pytest.approx(0.25)
    assert compute_metrics(r, 2.0).slo_attainment is None
    assert is_good(r[2], {"tpot": 0})  # one output token: TPOT counts as 0
    assert not is_good(r[3], {"ttft": 10_000})  # failures are never good


def test_empty_sample_reports_zero():
    m = compute_metrics([results()[3]], duration=1.0, slos={"ttft": 1})
    assert (m.completed, m.failed, m.request_goodput) == (0, 1, 0.0)
    assert m.latency["p99_ttft_ms"] == 0.0 and m.latency["mean_itl_ms"] == 0.0
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(results(), duration=0.0)


def test_vllm_field_names():
    d = compute_metrics(results(), 2.0, {"ttft": 400}).to_dict()
    for key in ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "total_input_tokens", "total_output_tokens", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
                "mean_e2el_ms", "p99_e2el_ms", "std_e2el_ms"):
        assert key in d, key
    assert d["request_goodput"] == pytest.approx(1.0)  # r2 and r3 have TTFT <= 400 ms


def test_parse_goodput_and_names():
    assert parse_goodput(["ttft:2000", "tpot:200", "e2el:1e4"]) == {"ttft": 2000.0, "tpot": 200.0, "e2el": 10000.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert percentile_name(99.0) == "p99" and percentile_name(99.9) == "p99.9"


def test_max_concurrency_seen_back_to_back():
    # one request ends exactly when the next starts: never two in flight
    rs = [RequestResult(start=0.0, latency=1.0), RequestResult(start=1.0, latency=1.0)]
    assert max_concurrency_seen(rs) == 1


def test_max_sustained_rate():
    sweep = [(2.0, 0.85), (0.5, 1.0), (1.0, 0.95), (4.0, 0.95)]  # unordered; 4 req/s passes again after 2 fails
    assert max_sustained_rate(sweep) == 1.0  # the goal must hold at every lower rate too
    assert max_sustained_rate(sweep, goal=0.8) == 4.0
    assert max_sustained_rate(sweep, goal=1.0) == 0.5
    assert max_sustained_rate([(0.5, 0.5), (1.0, 1.0)]) is None
    assert max_sustained_rate([(0.5, 1.0), (1.0, None), (2.0, 1.0)]) == 0.5  # no SLOs at a rate: a miss
    assert max_sustained_rate([(1.0, 0.9), (float("inf"), 0.9)]) == float("inf")
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="goal"):
            max_sustained_rate(sweep, goal=bad)
