"""PNG plots of benchmark results with matplotlib's Agg backend (no display needed): one run (latency
distributions and a timeline) and sweeps (throughput, p50/p99 TTFT and SLO attainment against offered load,
several servers)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402


def plot_run(run: Mapping[str, Any], path: str | Path) -> Path:
    """Four panels of one run (a :meth:`RunResult.to_dict` dict): TTFT, TPOT and ITL histograms (ms) and a
    timeline of each request's TTFT and end-to-end latency against its send time (s). Returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    ok = [i for i, e in enumerate(run["errors"]) if not e]
    ttft = np.array([run["ttfts"][i] for i in ok]) * 1000
    e2el = np.array([run["e2els"][i] for i in ok])
    starts = np.array([run["start_times"][i] for i in ok])
    outs = [run["output_lens"][i] for i in ok]
    tpot = np.array([(e2el[j] - ttft[j] / 1000) / (n - 1) * 1000 for j, n in enumerate(outs) if n > 1])
    itl = np.array([g for i in ok for g in run["itls"][i]]) * 1000
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, values, name in ((axes[0, 0], ttft, "TTFT"), (axes[0, 1], tpot, "TPOT (excl. 1st token)"),
                             (axes[1, 0], itl, "ITL")):
        if values.size:
            ax.hist(values, bins=min(40, max(5, values.size // 2)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "--"), (99, ":")):
                ax.axvline(np.percentile(values, q), color="black", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
    ax = axes[1, 1]
    ax.scatter(starts, ttft / 1000, s=10, label="TTFT")
    ax.scatter(starts, e2el, s=10, marker="x", label="end-to-end")
    ax.set_xlabel("send time (s from start)")
    ax.set_ylabel("latency (s)")
    ax.legend()
    fig.suptitle(f"{run.get('label') or run['model_id']}: rate {run['request_rate']} req/s, "
                 f"{run['completed']} ok / {run['failed']} failed, {run['output_throughput']:.1f} output tok/s")
    return _save(fig, path)


def _x_positions(rates: Sequence[Any], finite_max: float) -> list[float]:
    return [finite_max * 1.5 if (r == "inf" or (isinstance(r, float) and math.isinf(r))) else float(r)
            for r in rates]


def plot_sweep(panels: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], path: str | Path,
               goal: float | None = None) -> Path:
    """One row per panel (e.g. workload), each with output throughput, goodput / request throughput and p50 / p99
    TTFT against the offered request rate, plus the SLO attainment (%) when the runs had SLOs (with a line at
    ``goal``, a fraction, when given); one curve per series (e.g. server). ``panels[name][series]`` is a list of
    run dicts (:meth:`RunResult.to_dict`); the rate ``inf`` is drawn right of the largest finite rate. Returns
    the path.

    Raises:
        OSError: the file cannot be written.
    """
    with_slos = any(r.get("slo_attainment") is not None for series in panels.values() for runs in series.values()
                    for r in runs)
    ncols = 4 if with_slos else 3
    fig, axes = plt.subplots(len(panels), ncols, figsize=(5 * ncols, 4 * len(panels)), squeeze=False)
    for row, (panel, series) in enumerate(panels.items()):
        finite = [float(r["request_rate"]) for runs in series.values() for r in runs if r["request_rate"] != "inf"]
        finite_max = max(finite, default=1.0)
        for k, (name, runs) in enumerate(series.items()):
            color = f"C{k}"
            x = _x_positions([r["request_rate"] for r in runs], finite_max)
            axes[row, 0].plot(x, [r["output_throughput"] for r in runs], "o-", color=color, label=name)
            goodput = [r["request_goodput"] for r in runs]
            if all(g is not None for g in goodput):
                axes[row, 1].plot(x, goodput, "o-", color=color, label=f"{name} goodput")
            axes[row, 1].plot(x, [r["request_throughput"] for r in runs], "x--", color=color,
                              label=f"{name} throughput")
            axes[row, 2].plot(x, [r["median_ttft_ms"] / 1000 for r in runs], "o-", color=color, label=f"{name} p50")
            axes[row, 2].plot(x, [r["p99_ttft_ms"] / 1000 for r in runs], "s:", color=color, label=f"{name} p99")
            attained = [(xi, 100 * r["slo_attainment"]) for xi, r in zip(x, runs, strict=True)
                        if r.get("slo_attainment") is not None]
            if with_slos and attained:
                axes[row, 3].plot(*zip(*attained, strict=True), "o-", color=color, label=name)
        if with_slos and goal is not None:
            axes[row, 3].axhline(100 * goal, color="gray", linestyle="--", label=f"goal {goal:.0%}")
        ylabels = ("output tokens/s", "requests/s", "TTFT (s)", "requests within SLOs (%)")[:ncols]
        for ax, ylabel in zip(axes[row], ylabels, strict=True):
            ax.set_xlabel("offered rate (requests/s)")
            ax.set_ylabel(ylabel)
            ax.set_title(panel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            if any(r["request_rate"] == "inf" for runs in series.values() for r in runs):
                ticks = sorted(set(finite)) + [finite_max * 1.5]
                ax.set_xticks(ticks, [f"{t:g}" for t in sorted(set(finite))] + ["inf"])
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
