"""``leanserve advise --experiment``: verify the top recommendations that are ``leanserve serve`` flags on the
operator's machine instead of assuming them.

For each such recommendation (at most ``max_changes``, in rank order) a second server is started with the
observed server's flags (:class:`~leanserve.tools.advise_setup.Setup`) plus the change; the same workload is
replayed with ``leanserve bench`` on the observed server (before, once) and on the changed one (after), and the two
runs are compared side by side. A change helped when its target metric improved by at least
:data:`~leanserve.tools.advise_thresholds.MIN_IMPROVEMENT`; otherwise the report says it did not.

The replay is handed in (a :class:`Replay`, in practice :class:`leanserve.bench.replay.WorkloadReplay`: the
``tools`` and ``bench`` layers do not import each other), and so is the server launcher, so both can be faked.
"""

from __future__ import annotations

import ctypes
import math
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from leanserve.tools.advise_advice import Recommendation
from leanserve.tools.advise_setup import Setup, apply_change, change_flags, config_to_flags
from leanserve.tools.advise_thresholds import MIN_IMPROVEMENT
from leanserve.tools.banner import wait_for_banner_url

import httpx


class Replay(Protocol):
    """Sends the same requests to any server and returns a ``leanserve bench`` run dict."""

    workload: str
    num_prompts: int
    request_rate: float

    def run(self, base_url: str, label: str, api_key: str | None = None) -> dict[str, Any]: ...


# Compared side by side: bench JSON key (``server_metrics.`` for the server's view), label, better direction.
COMPARED: tuple[tuple[str, str, str | None], ...] = (
    ("request_throughput", "requests/s", "higher"), ("output_throughput", "output tok/s", "higher"),
    ("mean_ttft_ms", "mean TTFT (ms)", "lower"), ("median_ttft_ms", "p50 TTFT (ms)", "lower"),
    ("p99_ttft_ms", "p99 TTFT (ms)", "lower"), ("median_tpot_ms", "p50 TPOT (ms)", "lower"),
    ("p99_tpot_ms", "p99 TPOT (ms)", "lower"), ("mean_e2el_ms", "mean E2EL (ms)", "lower"),
    ("slo_attainment", "within SLOs", "higher"),
    ("server_metrics.mean_queue_time_ms", "mean queue (ms)", "lower"),
    ("server_metrics.peak_kv_cache_usage_perc", "peak KV usage", None),
    ("server_metrics.num_preemptions", "preemptions", "lower"),
    ("server_metrics.prefix_cache_hit_rate", "prefix-cache hits", "higher"),
    ("failed", "failed requests", "lower"),
)


def run_value(run: dict[str, Any], key: str) -> float | None:
    """``run[key]``, or ``run["server_metrics"][name]`` for ``server_metrics.name``; None when absent."""
    if key.startswith("server_metrics."):
        run = run.get("server_metrics") or {}
        key = key.removeprefix("server_metrics.")
    value = run.get(key)
    return float(value) if isinstance(value, int | float) else None


def improvement(before: float | None, after: float | None, direction: str) -> float | None:
    """Relative improvement of ``after`` over ``before`` (positive = better in ``direction``, "lower" or
    "higher"); None when either is missing or ``before`` is 0."""
    if before is None or after is None or before == 0:
        return None
    return (before - after) / abs(before) if direction == "lower" else (after - before) / abs(before)


@dataclass
class Experiment:
    """One change tried: the flags, the runs' numbers side by side and the verdict.

    Attributes:
        rows: ``{"metric", "label", "before", "after", "change_pct", "better"}`` per :data:`COMPARED` entry.
        target: ``[bench key, direction]`` judged; helped: whether it improved by >= MIN_IMPROVEMENT (None when
            not measured); verdict: one sentence; error: why it could not be measured ("" when it was);
            caveat: what limits the comparison (e.g. the observed server's flags were not given).
    """

    recommendation_id: str
    flags: list[str]
    server_args: list[str]
    workload: str
    num_prompts: int
    request_rate: float | str
    target: list[str] | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    helped: bool | None = None
    verdict: str = ""
    error: str = ""
    caveat: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """The :data:`COMPARED` rows of two bench runs."""
    rows = []
    for key, label, direction in COMPARED:
        b, a = run_value(before, key), run_value(after, key)
        gain = None if direction is None else improvement(b, a, direction)
        rows.append({"metric": key, "label": label, "before": b, "after": a,
                     "change_pct": None if b in (None, 0) or a is None else 100.0 * (a - b) / abs(b),
                     "better": None if gain is None else gain > 0})
    return rows


def judge(rec: Recommendation, before: dict[str, Any], after: dict[str, Any]) -> tuple[bool | None, str]:
    """(helped, verdict) of ``rec``'s change from its target metric in the two runs."""
    if rec.target is None:
        return None, "no target metric to judge by"
    key, direction = rec.target
    b, a = run_value(before, key), run_value(after, key)
    gain = improvement(b, a, direction)
    flags = " ".join(change_flags(rec.serve_changes or {})) or "leanserve serve"
    if gain is None:
        return None, f"{rec.id} ({flags}): {key} not measured in both runs"
    moved = f"{key} {b:.4g} -> {a:.4g} ({100 * gain:+.1f}% better)" if gain >= 0 else \
        f"{key} {b:.4g} -> {a:.4g} ({-100 * gain:.1f}% worse)"
    failed = run_value(after, "failed") or 0
    if failed:
        return False, f"{rec.id} ({flags}): did not help: {failed:g} requests failed after the change; {moved}"
    if gain >= MIN_IMPROVEMENT:
        return True, f"{rec.id} ({flags}): helped: {moved}"
    if gain > -MIN_IMPROVEMENT:
        return False, f"{rec.id} ({flags}): did not help: {moved}, within the {MIN_IMPROVEMENT:.0%} noise margin"
    return False, f"{rec.id} ({flags}): did not help, made it worse: {moved}"


def _stop_with_parent() -> None:
    """In the child, before exec: on Linux, have the kernel send SIGINT when the parent dies, so that a killed
    ``advise`` does not leave its second server running (elsewhere: nothing)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


WARM_UP_PROMPTS = ("Hello", "Say three words about the sea. " * 40)  # a short prompt, then a ~350-token one


def warm_up(url: str, timeout_s: float = 120.0) -> None:
    """Send a short and a longer completion (a few tokens each) so that the measured replay does not pay the new
    server's first-request costs (thread pools starting, kernels loading, the KV pool's pages first touched): the
    observed server is warm from its traffic. Errors are ignored: the replay reports any real failure."""
    try:
        model = httpx.get(f"{url}/v1/models", timeout=timeout_s).json()["data"][0]["id"]
        for prompt in WARM_UP_PROMPTS:
            httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0}, timeout=timeout_s)
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        pass


class ServeProcess:
    """``leanserve serve FLAGS`` (this interpreter's leanserve) on 127.0.0.1 and a free port, as a context manager:
    ``url`` is read from the banner it prints once listening, then the server is warmed up (:func:`warm_up`);
    leaving the block stops it with SIGINT (Ctrl-C).

    Raises:
        RuntimeError: on entry, when the server exits or prints no URL within ``timeout_s`` seconds.
    """

    def __init__(self, flags: Sequence[str], timeout_s: float = 300.0) -> None:
        self.cmd = [sys.executable, "-m", "leanserve.cli", "serve", *flags, "--host", "127.0.0.1", "--port", "0",
                    "--log-level", "warning"]
        self.timeout_s = timeout_s
        self.url = ""
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServeProcess:
        err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                     preexec_fn=_stop_with_parent)
        self.url = wait_for_banner_url(self.proc, self.timeout_s)
        if not self.url:
            self.__exit__()
            err.seek(0)
            raise RuntimeError(f"`{' '.join(self.cmd)}` did not start: {err.read()[-1500:]}")
        warm_up(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_experiments(recs: Sequence[Recommendation], setup: Setup, replay: Replay, api_key: str | None = None,
                    max_changes: int = 1, launcher: Callable[[list[str]], Any] = ServeProcess,
                    log: Callable[[str], None] = lambda _: None) -> list[Experiment]:
    """Try the first ``max_changes`` recommendations of ``recs`` that carry ``serve_changes`` (see the module doc).
    A change that cannot be applied or measured is reported with its ``error``, never raised."""
    chosen = [r for r in recs if r.serve_changes is not None][:max_changes]
    if not chosen:
        return []
    rate = "inf" if math.isinf(replay.request_rate) else replay.request_rate
    log(f"experiment: replaying {replay.num_prompts} {replay.workload} requests on {setup.base_url} (before)")
    before = replay.run(setup.base_url, "before", api_key)
    out = []
    for rec in chosen:
        exp = Experiment(rec.id, change_flags(rec.serve_changes), [], replay.workload, replay.num_prompts, rate,
                         list(rec.target) if rec.target else None)
        if not setup.known:
            exp.caveat = ("the observed server's flags were not given (--serve-args): the second server ran "
                          "leanserve's defaults plus the change, so more than the change may differ")
        try:
            exp.server_args = config_to_flags(apply_change(setup.engine, rec.serve_changes))
            log(f"experiment: starting leanserve serve {' '.join(exp.server_args)}")
            with launcher(exp.server_args) as server:
                log(f"experiment: replaying on {server.url} (after {rec.id})")
                after = replay.run(server.url, f"after {rec.id}")
        except Exception as exc:  # noqa: BLE001 - a failed trial is reported, the advice still stands
            exp.error = f"{type(exc).__name__}: {exc}"
            exp.verdict = f"{rec.id}: not measured: {exp.error}"
            out.append(exp)
            continue
        exp.rows = compare(before, after)
        exp.helped, exp.verdict = judge(rec, before, after)
        out.append(exp)
    return out
