"""Presenting ``leanserve eval`` results: a text table, the ``--max-drop`` gate and a PNG bar chart."""

from __future__ import annotations

from leanserve.tools.eval_result import ConfigResult


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: list[ConfigResult]) -> str:
    """One row per configuration; agreement is against the first row (the baseline)."""
    head = (f"{'config':<16}{'ppl':>9}{'ppl vs base':>12}{'accuracy':>10}{'1st tok':>9}{'32 tok':>8}"
            f"{'weights MB':>11}{'KV B/tok':>10}{'tok/s b1':>10}{'tok/s b32':>10}")
    base = results[0].perplexity
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{r.name:<16}{r.perplexity:>9.3f}{(r.perplexity / base - 1) * 100:>+11.2f}%"
                    f"{_fmt(r.accuracy, '.1%'):>10}{_fmt(r.first_token_agreement, '.0%'):>9}"
                    f"{_fmt(r.continuation_agreement, '.0%'):>8}{r.weight_bytes / 1e6:>11.1f}"
                    f"{r.kv_bytes_per_token:>10,}"
                    f"{_fmt(r.decode_tok_s_b1, '.1f'):>10}{_fmt(r.decode_tok_s_b32, '.1f'):>10}")
    return "\n".join(rows)


def gate_failures(results: list[ConfigResult], max_drop: float | None) -> list[str]:
    """Configurations whose test-set accuracy is more than ``max_drop`` below the baseline's (first row)."""
    if max_drop is None or results[0].accuracy is None:
        return []
    base = results[0].accuracy
    return [f"{r.name}: accuracy {r.accuracy:.1%} is {base - r.accuracy:.1%} below the baseline's {base:.1%} "
            f"(--max-drop {max_drop:.1%})" for r in results[1:]
            if r.accuracy is not None and base - r.accuracy > max_drop + 1e-12]


def write_png(results: list[ConfigResult], path: str) -> None:
    """Bar charts of perplexity, accuracy, weight MB and (when measured) decode tok/s per configuration.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    panels = [("perplexity", [r.perplexity for r in results]),
              ("test-set accuracy", [r.accuracy or 0.0 for r in results]),
              ("weights (MB)", [r.weight_bytes / 1e6 for r in results])]
    if all(r.decode_tok_s_b1 is not None for r in results):
        panels.append(("decode tok/s, batch 1", [r.decode_tok_s_b1 for r in results]))
        panels.append(("decode tok/s, batch 32", [r.decode_tok_s_b32 for r in results]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color="#4c72b0")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
