"""``leanserve advise``'s outputs: the compact terminal report (:func:`format_text`), the JSON payload
(:func:`payload`: ``{"metrics", "recommendations", ...}``) and one self-contained HTML page (:func:`write_html`:
the plots as embedded PNGs, matplotlib's Agg backend, and the ranked advice)."""

from __future__ import annotations

import base64
import io
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leanserve.tools.advise_advice import Recommendation
from leanserve.tools.advise_experiment import Experiment
from leanserve.tools.advise_rules import RULES
from leanserve.tools.advise_setup import Setup
from leanserve.tools.advise_snapshot import Dist, Snapshot
from leanserve.tools.advise_thresholds import STEPS

import jinja2
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

WIDTH = 118


def _num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.{digits}f}" if abs(x) < 1e15 else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _dist(d: Dist | None, digits: int = 0) -> str:
    if d is None:
        return "n/a"
    if not d.count:
        return "none finished"
    return " | ".join(_num(v, digits) for v in (d.mean, d.p50, d.p99)) + ("" if d.exact else "  (buckets)")


def metric_rows(s: Snapshot) -> list[tuple[str, str, str]]:
    """``(metric, value, where from)`` rows of the report's metrics table (the seed's section 9)."""
    o = s.origin

    def src(*names: str) -> str:
        return "/".join(sorted({o[n] for n in names if n in o})) or "-"

    parts = " | ".join(_num(d.mean if d else None, 0) for d in (s.queue_ms, s.prefill_ms, s.decode_ms))
    return [
        ("requests finished", "n/a" if s.requests is None else str(s.requests), src("requests")),
        ("throughput req/s | prompt tok/s | output tok/s",
         f"{_num(s.request_throughput, 2)} | {_num(s.prompt_throughput)} | {_num(s.output_throughput)}",
         src("request_throughput", "output_throughput")),
        ("TTFT mean | p50 | p99 (ms)", _dist(s.ttft_ms), src("ttft_ms")),
        ("  queue | prefill | decode, mean (ms)", parts, src("queue_ms", "prefill_ms", "decode_ms")),
        ("  queue share of TTFT", _pct(s.queue_share_of_ttft), src("queue_ms")),
        ("TPOT mean | p50 | p99 (ms)", _dist(s.tpot_ms, 1), src("tpot_ms")),
        ("ITL mean | p50 | p99 (ms)", _dist(s.itl_ms, 1), src("itl_ms")),
        ("E2E latency mean | p50 | p99 (ms)", _dist(s.e2el_ms), src("e2el_ms")),
        ("prompt tokens mean | p50 | p99", _dist(s.prompt_tokens), src("prompt_tokens")),
        ("output tokens mean | p50 | p99", _dist(s.output_tokens), src("output_tokens")),
        ("time in prefill | decode", "n/a" if s.prefill_share is None else
         f"{_pct(s.prefill_share)} | {_pct(1 - s.prefill_share)}", src("prefill_share")),
        ("prefill speed (computed tok/s per request)", _num(s.prefill_tokens_per_s, 0), src("prefill_tokens_per_s")),
        ("KV usage peak | mean", f"{_pct(s.kv_usage_peak)} | {_pct(s.kv_usage_mean)}", src("kv_usage_peak")),
        ("running peak | waiting peak | mean in flight",
         f"{_num(s.running_peak, 0)} | {_num(s.waiting_peak, 0)} | {_num(s.mean_concurrency, 2)}",
         src("running_peak", "mean_concurrency")),
        ("preemptions", _num(s.preemptions, 0), src("preemptions")),
        ("prefix-cache hit rate", _pct(s.prefix_cache_hit_rate), src("prefix_cache_hit_rate")),
        ("speculative acceptance rate", _pct(s.spec_acceptance_rate), src("spec_acceptance_rate")),
        ("answer-cache hit rate", _pct(s.answer_cache_hit_rate), src("answer_cache_hit_rate")),
        ("server memory (MiB resident)", _num(None if s.resident_memory_bytes is None
                                              else s.resident_memory_bytes / 2**20, 0), src("resident_memory_bytes")),
    ]


def _wrap(label: str, text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=f"   {label:<10}", subsequent_indent=" " * 13) or [f"   {label}"]


def _evidence(rec: Recommendation) -> str:
    return ", ".join(f"{k}={', '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in rec.evidence.items()
                     if v is not None)


def format_text(s: Snapshot, recs: Sequence[Recommendation], setup: Setup,
                experiments: Sequence[Experiment] = ()) -> str:
    """The terminal report: what was read, the metrics table, what it cannot see, the ranked advice and the
    experiments side by side."""
    lines = [f"leanserve advise: {setup.base_url} ({s.server_kind}"
             + (f", {s.model}" if s.model else "") + (f", max_model_len {s.max_model_len}" if s.max_model_len
                                                      else "") + ")"]
    lines += [f"read: {src}" for src in s.sources] or ["read: nothing (no /metrics, no --bench-json)"]
    lines.append(f"{'metric':<48}{'value':<40}from")
    lines += [f"{m:<48}{v:<40}{o}" for m, v, o in metric_rows(s)]
    if s.unseen:
        lines += textwrap.wrap("cannot see: " + "; ".join(f"{what} ({how})" for what, how in s.unseen), WIDTH,
                               subsequent_indent="  ")
    lines.append("")
    lines += textwrap.wrap("recommendations, in the seed's order (" + ", ".join(
        f"{k} {v.split(' (')[0].split(':')[0]}" for k, v in STEPS.items()) + "):", WIDTH)
    for i, rec in enumerate(recs, 1):
        lines.append(f"{i}. [step {rec.step}] {rec.id}: {rec.title}")
        for label, text in (("evidence", _evidence(rec)), ("change", rec.change), ("expected", rec.expected_effect),
                            ("basis", rec.basis), ("risk", rec.risk)):
            lines += _wrap(label, text)
        for alt in rec.alternatives:
            lines += _wrap("or", alt)
    for exp in experiments:
        lines.append("")
        lines += textwrap.wrap(f"experiment {exp.recommendation_id}: {' '.join(exp.flags) or '(leanserve serve)'}; "
                               f"{exp.num_prompts} {exp.workload} requests at {exp.request_rate} req/s; before: the "
                               "observed server, after: leanserve serve " + " ".join(exp.server_args), WIDTH,
                               subsequent_indent="   ")
        if exp.rows:
            lines.append(f"   {'metric':<24}{'before':>14}{'after':>14}{'change':>10}")
            for row in (r for r in exp.rows if r["before"] is not None or r["after"] is not None):
                change = "" if row["change_pct"] is None else f"{row['change_pct']:+.1f}%"
                lines.append(f"   {row['label']:<24}{_num(row['before'], 2):>14}{_num(row['after'], 2):>14}"
                             f"{change:>10}")
        lines += _wrap("verdict", exp.verdict)
        if exp.caveat:
            lines += _wrap("caveat", exp.caveat)
    return "\n".join(lines)


def payload(s: Snapshot, recs: Sequence[Recommendation], setup: Setup,
            experiments: Sequence[Experiment] = ()) -> dict[str, Any]:
    """The ``--json`` document: ``{"metrics", "recommendations" (ranked), "experiments", "setup", "rules"}``."""
    return {"metrics": s.to_dict(), "recommendations": [r.to_dict() for r in recs],
            "experiments": [e.to_dict() for e in experiments],
            "setup": {"base_url": setup.base_url, "known": setup.known, "workload": setup.workload,
                      "max_model_len": setup.max_model_len, "engine": vars(setup.engine)},
            "rules": [{"id": r.id, "step": r.step, "when": r.when, "source": r.source, "fallback": r.fallback}
                      for r in RULES]}


# ---------------------------------------------------------------------------------------------------- HTML
def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plot_latency(s: Snapshot) -> str | None:
    """TTFT distribution (per-request values, else the histogram's buckets) and the mean parts of a request
    (queue, prefill, decode), as a base64 PNG; None when there is nothing to draw."""
    parts = [(name, d.mean) for name, d in (("queue", s.queue_ms), ("prefill", s.prefill_ms),
                                            ("decode", s.decode_ms)) if d is not None and d.mean is not None]
    if not s.ttft_samples_ms and not any(c for _, c in s.ttft_buckets) and not parts:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    if s.ttft_samples_ms:
        left.hist(s.ttft_samples_ms, bins=min(30, max(5, len(s.ttft_samples_ms) // 2)), color="tab:blue")
        left.set_xlabel("TTFT (ms), per request")
    else:
        used = [(le, c) for le, c in s.ttft_buckets if c]
        left.bar([f"<={le:g}" for le, _ in used], [c for _, c in used], color="tab:blue")
        left.set_xlabel("TTFT histogram bucket (ms)")
        left.tick_params(axis="x", rotation=45)
    left.set_ylabel("requests")
    left.set_title("TTFT distribution")
    start = 0.0
    for (name, value), color in zip(parts, ("tab:orange", "tab:green", "tab:purple"), strict=False):
        right.barh(["mean request"], [value], left=[start], color=color, label=f"{name} {value:,.0f} ms")
        start += value
    right.set_xlabel("ms (queue + prefill = TTFT, then decode)")
    right.set_title("where a request's time goes")
    if parts:
        right.legend(fontsize=8)
    return _png(fig)


def plot_kv(s: Snapshot) -> str | None:
    """KV-cache usage (%) over the sampling window, as a base64 PNG; None with fewer than 2 polls."""
    if len(s.kv_series) < 2:
        return None
    fig, ax = plt.subplots(figsize=(11, 2.8))
    ax.plot([t for t, _ in s.kv_series], [100 * v for _, v in s.kv_series], "-", color="tab:red")
    ax.set_ylim(0, 100)
    ax.set_xlabel("seconds into the window")
    ax.set_ylabel("KV usage (%)")
    ax.set_title("KV cache over the window")
    return _png(fig)


def plot_experiment(exp: Experiment) -> str | None:
    """Before / after bars of an experiment's latency and throughput rows, as a base64 PNG."""
    keys = ("mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput", "request_throughput")
    rows = [r for r in exp.rows if r["metric"] in keys and r["before"] is not None and r["after"] is not None]
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(rows), figsize=(2.4 * len(rows), 3.2), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        ax.bar(["before", "after"], [row["before"], row["after"]], color=["tab:gray", "tab:blue"])
        ax.set_title(row["label"], fontsize=9)
    fig.suptitle(f"{exp.recommendation_id}: {' '.join(exp.flags)}", fontsize=10)
    return _png(fig)


PAGE = jinja2.Template("""<!doctype html>
<html><head><meta charset="utf-8"><title>leanserve advise: {{ setup.base_url }}</title>
<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse}td,th{border-bottom:1px solid #ddd;padding:3px 10px;text-align:left}
.rec{border-left:4px solid #36c;padding:4px 12px;margin:12px 0;background:#f7f9fc}.k{color:#666;width:7em}
.bad{color:#b00}.good{color:#070}</style></head><body>
<h1>leanserve advise</h1>
<p>{{ setup.base_url }} ({{ s.server_kind }}{% if s.model %}, {{ s.model }}{% endif %}).
{% for src in s.sources %}{{ src }}. {% endfor %}</p>
<h2>Recommendations, in the seed's order</h2>
{% for r in recs %}<div class="rec"><b>{{ loop.index }}. step {{ r.step }} ({{ steps[r.step] }}): {{ r.title }}</b>
<table>{% for k, v in [("evidence", evidence(r)), ("change", r.change), ("expected", r.expected_effect),
("basis", r.basis), ("risk", r.risk), ("source", r.source)] %}<tr><td class="k">{{ k }}</td><td>{{ v }}</td></tr>
{% endfor %}{% for a in r.alternatives %}<tr><td class="k">or</td><td>{{ a }}</td></tr>{% endfor %}</table></div>
{% endfor %}
{% for e, img in experiments %}<h2>Experiment: {{ e.recommendation_id }} ({{ e.flags|join(" ") }})</h2>
<p class="{{ 'good' if e.helped else 'bad' }}">{{ e.verdict }}</p>
{% if e.caveat %}<p>Caveat: {{ e.caveat }}</p>{% endif %}
<p>{{ e.num_prompts }} {{ e.workload }} requests at {{ e.request_rate }} req/s; before: the observed server;
after: <code>leanserve serve {{ e.server_args|join(" ") }}</code></p>
{% if img %}<img src="data:image/png;base64,{{ img }}">{% endif %}
{% if e.rows %}<table><tr><th>metric</th><th>before</th><th>after</th><th>change</th></tr>
{% for row in e.rows %}<tr><td>{{ row.label }}</td><td>{{ num(row.before) }}</td><td>{{ num(row.after) }}</td>
<td>{{ "" if row.change_pct is none else "%+.1f%%"|format(row.change_pct) }}</td></tr>{% endfor %}</table>{% endif %}
{% endfor %}
<h2>Metrics</h2>
{% if latency %}<img src="data:image/png;base64,{{ latency }}">{% endif %}
{% if kv %}<img src="data:image/png;base64,{{ kv }}">{% else %}<p>No KV series: fewer than 2 polls of the KV gauge.</p>
{% endif %}
<table><tr><th>metric</th><th>value</th><th>from</th></tr>
{% for m, v, o in rows %}<tr><td>{{ m }}</td><td>{{ v }}</td><td>{{ o }}</td></tr>{% endfor %}</table>
{% if s.unseen %}<p>Cannot see: {% for what, how in s.unseen %}{{ what }} ({{ how }}){{ "; " if not loop.last }}
{% endfor %}</p>{% endif %}
</body></html>
""", autoescape=True)


def write_html(path: str | Path, s: Snapshot, recs: Sequence[Recommendation], setup: Setup,
               experiments: Sequence[Experiment] = ()) -> Path:
    """Write the one-page report (plots embedded as base64 PNGs). Returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    html = PAGE.render(s=s, recs=recs, setup=setup, steps=STEPS, rows=metric_rows(s), evidence=_evidence,
                       num=lambda x: _num(x, 2), latency=plot_latency(s), kv=plot_kv(s),
                       experiments=[(e, plot_experiment(e)) for e in experiments])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out
