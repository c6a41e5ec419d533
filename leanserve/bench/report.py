"""Benchmark reports: the stdout tables (one run, in vLLM ``bench serve``'s layout; a sweep, one line per rate)
and the JSON file."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from leanserve.bench.runner import RunResult
from leanserve.bench.stats import max_sustained_rate, percentile_name

LATENCY_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
                  "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
WIDTH = 50


def _pct(fraction: float | None) -> float | None:
    return None if fraction is None else 100.0 * fraction


def _line(out: TextIO, label: str, value: Any, digits: int = 2) -> None:
    text = "n/a" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))
    out.write(f"{label:<40}{text:<10}\n")


def print_run(run: RunResult, out: TextIO = sys.stdout) -> None:
    """The result of one run as a text table."""
    d = run.to_dict()
    m = run.metrics
    title = f" Serving Benchmark Result {run.label} ".replace("  ", " ")
    out.write(f"{title:=^{max(WIDTH, len(title) + 6)}}\n")
    _line(out, "Model:", run.model_id)
    _line(out, "Request rate (req/s):", d["request_rate"])
    _line(out, "Max concurrency:", d["max_concurrency"])
    _line(out, "Successful requests:", m.completed)
    _line(out, "Failed requests:", m.failed)
    _line(out, "Benchmark duration (s):", m.duration)
    _line(out, "Total input tokens:", m.total_input_tokens)
    _line(out, "Total generated tokens:", m.total_output_tokens)
    _line(out, "Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        _line(out, "Goodput SLOs:", " ".join(f"{k}<={v:g}ms" for k, v in run.config.slos.items()))
        _line(out, "Request goodput (req/s):", m.request_goodput)
        _line(out, "SLO attainment (%):", _pct(m.slo_attainment))
    _line(out, "Output token throughput (tok/s):", m.output_throughput)
    _line(out, "Total token throughput (tok/s):", m.total_token_throughput)
    _line(out, "Peak concurrent requests:", m.max_concurrent_requests)
    for key, (long, short) in LATENCY_TITLES.items():
        out.write(f"{long:-^{WIDTH}}\n")
        _line(out, f"Mean {short} (ms):", m.latency[f"mean_{key}_ms"])
        _line(out, f"Median {short} (ms):", m.latency[f"median_{key}_ms"])
        for p in run.config.percentiles:
            if p != 50:
                _line(out, f"P{percentile_name(p)[1:]} {short} (ms):", m.latency[f"{percentile_name(p)}_{key}_ms"])
    if run.server is not None:
        s = run.server
        out.write(f"{'Server metrics (/metrics)':-^{WIDTH}}\n")
        _line(out, "Peak KV cache usage (%):", _pct(s.peak_kv_cache_usage_perc))
        _line(out, "Peak running / waiting requests:",
              f"{s.peak_num_requests_running or 0:g} / {s.peak_num_requests_waiting or 0:g}")
        _line(out, "Preemptions:", None if s.num_preemptions is None else int(s.num_preemptions))
        _line(out, "Prefix cache hit rate (%):", _pct(s.prefix_cache_hit_rate))
        _line(out, "Mean queue time (ms):", s.mean_queue_time_ms)
        if s.spec_acceptance_rate is not None:
            _line(out, "Draft acceptance rate (%):", _pct(s.spec_acceptance_rate))
            _line(out, "Mean acceptance length:", s.spec_mean_acceptance_length)
    errors = sorted({r.error for r in run.results if r.error})
    for err in errors[:3]:
        out.write(f"error: {err[:200]}\n")
    out.write("=" * WIDTH + "\n")


def sweep_rows(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One summary dict per run of a sweep: offered rate, throughputs, goodput, p50/p99 TTFT and TPOT."""
    rows = []
    for run in runs:
        d = run.to_dict()
        rows.append({k: d.get(k) for k in (
            "request_rate", "completed", "failed", "request_throughput", "output_throughput", "request_goodput",
            "slo_attainment", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")})
    return rows


def sweep_sustained_rate(runs: Sequence[RunResult], goal: float) -> float | None:
    """The max sustained rate (requests/s) of a sweep's runs: :func:`leanserve.bench.stats.max_sustained_rate` over
    each run's offered rate and SLO attainment. None when no rate qualifies (or the runs had no SLOs).

    Raises:
        ValueError: ``goal`` is not in (0, 1].
    """
    return max_sustained_rate([(r.config.request_rate, r.metrics.slo_attainment) for r in runs], goal)


def print_sweep(runs: Sequence[RunResult], out: TextIO = sys.stdout, goal: float = 0.9) -> None:
    """A sweep as one line per offered rate, then (with SLOs) the max sustained rate: the highest rate whose SLO
    attainment, and that of every lower rate, is >= ``goal`` (see :func:`leanserve.bench.stats.max_sustained_rate`).
    """
    head = ("rate", "ok", "fail", "req/s", "out tok/s", "goodput", "SLO %", "p50 TTFT", "p99 TTFT", "p50 TPOT",
            "p99 TPOT")
    out.write("".join(f"{h:>10}" for h in head) + "\n")
    rows = sweep_rows(runs)
    for row in rows:
        cells = [row["request_rate"], row["completed"], row["failed"], row["request_throughput"],
                 row["output_throughput"], row["request_goodput"], _pct(row["slo_attainment"]),
                 row["median_ttft_ms"], row["p99_ttft_ms"], row["median_tpot_ms"], row["p99_tpot_ms"]]
        out.write("".join(f"{'n/a' if c is None else (f'{c:.2f}' if isinstance(c, float) else c):>10}"
                          for c in cells) + "\n")
    out.write("(latencies in ms; goodput in requests/s meeting every SLO; SLO %: share of sent requests that do)\n")
    if any(row["slo_attainment"] is not None for row in rows):
        best = sweep_sustained_rate(runs, goal)
        out.write(f"max sustained rate (SLO attainment >= {goal:.0%} up to it): "
                  f"{'none of the swept rates' if best is None else f'{best:g} req/s'}\n")
    else:
        out.write("(no SLOs given: pass --goodput for goodput, SLO attainment and the max sustained rate)\n")


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON, creating parent folders. Returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str))
    return out
