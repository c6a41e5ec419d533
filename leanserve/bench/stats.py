"""Benchmark statistics with vLLM ``bench serve``'s definitions and JSON field names.

- TTFT: time to the first output text; E2EL: end-to-end latency.
- TPOT per request: ``(e2el - ttft) / (output_tokens - 1)``, the first token excluded (requests with one output
  token have none). ITL: every gap between consecutive output chunks, over all requests.
- Throughputs divide by the benchmark's duration; input / output tokens count successful requests only.
- Goodput: successful requests per second that meet every given SLO (TTFT, TPOT, E2EL, in milliseconds);
  SLO attainment: the fraction of sent requests that do.
- Max sustained rate over a sweep: the highest offered rate at which the SLO attainment (and at every lower swept
  rate) reaches a goal such as 90%, the "goodput" of DistServe (Zhong et al., OSDI 2024, section 2).
- Percentiles interpolate linearly (``numpy.percentile``'s default); an empty sample reports 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from leanserve.bench.client import RequestResult

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:2000", "tpot:200"]`` -> ``{"ttft": 2000.0, "tpot": 200.0}`` (milliseconds).

    Raises:
        ValueError: an item is not ``NAME:MS`` with NAME in ttft / tpot / e2el and MS a number >= 0.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO must be NAME:MS with NAME in {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if ms < 0:
            raise ValueError(f"goodput SLO {item!r} must be >= 0 ms")
        slos[name] = ms
    return slos


def tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first: ``(latency - ttft) / (output_tokens - 1)``; None with < 2 tokens."""
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def percentile_name(p: float) -> str:
    """``99.0`` -> ``"p99"``, ``99.9`` -> ``"p99.9"`` (vLLM's key spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize_ms(values_s: Sequence[float], name: str, percentiles: Sequence[float]) -> dict[str, float]:
    """``mean_/median_/std_/pNN_{name}_ms`` of a sample in seconds, reported in milliseconds (0 when empty)."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    empty = ms.size == 0
    out = {f"mean_{name}_ms": 0.0 if empty else float(ms.mean()),
           f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
           f"std_{name}_ms": 0.0 if empty else float(ms.std())}
    for p in percentiles:
        out[f"{percentile_name(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def is_good(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (milliseconds); a one-token output has TPOT 0, as in vLLM."""
    if not result.success:
        return False
    values = {"ttft": result.ttft, "tpot": tpot(result) or 0.0, "e2el": result.latency}
    return all(values[k] * 1000.0 <= limit for k, limit in slos.items())


def max_concurrency_seen(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once, from their send times and latencies."""
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.latency, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    peak = level = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


@dataclass
class BenchmarkMetrics:
    """The result of one run. Durations in seconds, throughputs per second, latencies (``latency``) in ms.

    ``latency`` maps vLLM's names (``mean_ttft_ms``, ``median_tpot_ms``, ``p99_itl_ms``, ``std_e2el_ms``...)
    to values. ``request_goodput`` is None when no SLO was given.
    """

    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_concurrent_requests: int
    slo_attainment: float | None = None
    latency: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, float | int | None]:
        """Flat dict with vLLM ``bench serve``'s field names."""
        out = {k: v for k, v in self.__dict__.items() if k != "latency"}
        out.update(self.latency)
        return out


def compute_metrics(results: Sequence[RequestResult], duration: float, slos: dict[str, float] | None = None,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> BenchmarkMetrics:
    """Aggregate per-request results of a run that lasted ``duration`` seconds.

    Raises:
        ValueError: ``duration`` is not positive.
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration}")
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in (tpot(r) for r in ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    latency: dict[str, float] = {}
    for name in LATENCY_METRICS:
        latency.update(summarize_ms(samples[name], name, percentiles))
    good = sum(is_good(r, slos) for r in ok) if slos else None
    goodput = None if good is None else good / duration
    attainment = None if good is None or not results else good / len(results)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration=duration, total_input_tokens=input_tokens,
        total_output_tokens=output_tokens, request_throughput=len(ok) / duration, request_goodput=goodput,
        output_throughput=output_tokens / duration, total_token_throughput=(input_tokens + output_tokens) / duration,
        max_concurrent_requests=max_concurrency_seen(results), slo_attainment=attainment, latency=latency)


def max_sustained_rate(points: Sequence[tuple[float, float | None]], goal: float = 0.9) -> float | None:
    """The highest offered rate (requests/s) of a sweep whose SLO attainment, and that of every lower rate, is
    >= ``goal``: DistServe's goodput (Zhong et al., OSDI 2024). ``points`` are ``(rate, slo_attainment)`` pairs in
    any order; an attainment of None counts as a miss. None when even the lowest rate misses the goal.

    Raises:
        ValueError: ``goal`` is not in (0, 1].
    """
    if not 0 < goal <= 1:
        raise ValueError(f"SLO attainment goal must be in (0, 1], got {goal}")
    best = None
    for rate, attainment in sorted(points, key=lambda p: p[0]):
        if attainment is None or attainment < goal:
            break
        best = rate
    return best
