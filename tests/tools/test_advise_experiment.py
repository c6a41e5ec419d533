"""``--experiment`` with a fake replay and a fake server launcher: which changes are tried, with which flags, and
the verdicts (helped / within noise / worse / not measured); and the serve-flag plumbing it relies on."""

from __future__ import annotations

import math
from contextlib import contextmanager

from leanserve.config import EngineConfig
from leanserve.tools.advise_advice import Recommendation
from leanserve.tools.advise_experiment import compare, judge, run_experiments
from leanserve.tools.advise_setup import Setup, apply_change, change_flags, config_to_flags, parse_serve_args

import pytest


def test_serve_args_round_trip_through_engine_config():
    engine, known = parse_serve_args("--max-num-seqs 8 --kv-cache-memory 134217728 --no-enable-prefix-caching "
                                     "--host 0.0.0.0 --port 9000")
    assert known and engine.max_num_seqs == 8 and engine.kv_cache_memory == 128 << 20
    assert not engine.enable_prefix_caching
    flags = config_to_flags(engine)  # server options (host, port) are not the engine's
    assert flags == ["--kv-cache-memory", "134217728", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    assert parse_serve_args(" ".join(flags))[0] == engine
    assert parse_serve_args(None) == (EngineConfig(), False)
    with pytest.raises(ValueError, match="not a `leanserve serve` flag"):
        parse_serve_args("--max-num-seq 8 --bogus")
    with pytest.raises(ValueError, match="max_num_seqs"):
        parse_serve_args("--max-num-seqs 0")


def test_changes_become_flags():
    assert change_flags({"max_num_seqs": 32}) == ["--max-num-seqs", "32"]
    assert change_flags({"enable_prefix_caching": True}) == []  # back to the default: drop the switch
    assert change_flags({"kv_cache_dtype": "float16", "batch_invariant": True}) == [
        "--kv-cache-dtype", "float16", "--batch-invariant"]
    changed = apply_change(EngineConfig(max_num_seqs=8, enable_prefix_caching=False), {"enable_prefix_caching": True})
    assert config_to_flags(changed) == ["--max-num-seqs", "8"]


def rec(rid: str, changes: dict | None, target=("mean_ttft_ms", "lower")) -> Recommendation:
    return Recommendation(rid, 4, rid, {}, "change", "effect", "basis", "risk", serve_changes=changes, target=target)


def run(ttft: float, tok_s: float = 100.0, failed: int = 0) -> dict:
    return {"mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "output_throughput": tok_s,
            "request_throughput": 1.0, "failed": failed, "server_metrics": {"mean_queue_time_ms": ttft / 2,
                                                                          "num_preemptions": 0}}


class FakeReplay:
    workload, num_prompts, request_rate = "customer-service", 4, math.inf

    def __init__(self, results: dict[str, dict]) -> None:
        self.results, self.calls = results, []

    def run(self, base_url: str, label: str, api_key: str | None = None) -> dict:
        self.calls.append((base_url, label, api_key))
        return self.results[label]


class FakeServer:
    def __init__(self, url: str) -> None:
        self.url = url


def launcher_recording(started: list):
    @contextmanager
    def launch(flags):
        started.append(list(flags))
        yield FakeServer(f"http://127.0.0.1:{9000 + len(started)}")
    return launch


def test_experiment_tries_the_top_server_flag_changes_and_judges_them():
    recs = [rec("context-too-long", None), rec("queue-bound", {"max_num_seqs": 32}),
            rec("kv-pressure", {"kv_cache_dtype": "float16"}, ("output_throughput", "higher")),
            rec("speculation", {"max_num_seqs": 1})]
    replay = FakeReplay({"before": run(2000.0), "after queue-bound": run(800.0),
                         "after kv-pressure": run(1900.0, tok_s=102.0)})
    started: list = []
    setup = Setup(EngineConfig(max_num_seqs=8), known=True, base_url="http://127.0.0.1:8000")
    exps = run_experiments(recs, setup, replay, api_key="k", max_changes=2, launcher=launcher_recording(started))
    assert [e.recommendation_id for e in exps] == ["queue-bound", "kv-pressure"]  # the client-side one is skipped
    assert started == [["--max-num-seqs", "32"], ["--max-num-seqs", "8", "--kv-cache-dtype", "float16"]]
    assert replay.calls == [("http://127.0.0.1:8000", "before", "k"), ("http://127.0.0.1:9001", "after queue-bound",
                                                                        None),
                            ("http://127.0.0.1:9002", "after kv-pressure", None)]
    queue, kv = exps
    assert queue.helped is True and queue.flags == ["--max-num-seqs", "32"] and queue.request_rate == "inf"
    assert "helped: mean_ttft_ms 2000 -> 800 (+60.0% better)" in queue.verdict
    row = next(r for r in queue.rows if r["metric"] == "server_metrics.mean_queue_time_ms")
    assert (row["before"], row["after"], row["change_pct"], row["better"]) == (1000.0, 400.0, -60.0, True)
    assert kv.helped is False and "did not help" in kv.verdict and "within the 5% noise margin" in kv.verdict


def test_a_change_that_hurts_or_fails_is_reported_not_raised():
    worse = judge(rec("queue-bound", {"max_num_seqs": 32}), run(1000.0), run(1500.0))
    assert worse == (False, "queue-bound (--max-num-seqs 32): did not help, made it worse: mean_ttft_ms 1000 -> "
                            "1500 (50.0% worse)")
    failed = judge(rec("queue-bound", {"max_num_seqs": 32}), run(1000.0), run(500.0, failed=3))
    assert failed[0] is False and "3 requests failed" in failed[1]

    @contextmanager
    def broken(flags):
        raise RuntimeError("did not start")
        yield  # pragma: no cover

    replay = FakeReplay({"before": run(1000.0)})
    (exp,) = run_experiments([rec("queue-bound", {"max_num_seqs": 32})], Setup(), replay, launcher=broken)
    assert exp.helped is None and exp.rows == [] and "not measured: RuntimeError: did not start" in exp.verdict
    assert run_experiments([rec("context-too-long", None)], Setup(), replay) == []  # nothing to try: no run


def test_compare_rows_cover_latency_throughput_and_the_server_view():
    rows = {r["metric"]: r for r in compare(run(1000.0), run(500.0, tok_s=150.0))}
    assert rows["output_throughput"]["better"] is True and rows["output_throughput"]["change_pct"] == 50.0
    assert rows["p99_ttft_ms"]["after"] == 1000.0 and rows["server_metrics.num_preemptions"]["better"] is None
