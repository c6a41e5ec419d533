"""``leanserve bench`` end to end: the CLI against a live ``leanserve serve`` on the default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import repo_root
from tests.entrypoints.server_helpers import API_KEY, ServerProcess

PROMPTS = [("Name three rivers in Europe.", 8), ("What is a KV cache?", 12), ("Say hello in French.", 6),
           ("Count from one to five.", 10)]
PERCENTILE_KEYS = ("p50", "p90", "p99")


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--kv-cache-memory", str(128 << 20), "--max-model-len", "1024"]).start()
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "leanserve.cli", "bench", "--disable-tqdm", "--metrics-interval", "0.05", *args]
    return subprocess.run(cmd, cwd=repo_root(), capture_output=True, text=True, timeout=600)


def check_run(d: dict, num_prompts: int) -> None:
    """Every field present and consistent."""
    assert d["num_prompts"] == num_prompts
    assert d["completed"] + d["failed"] == num_prompts and d["failed"] == 0, d["errors"]
    assert d["total_input_tokens"] == sum(d["input_lens"]) > 0
    assert d["total_output_tokens"] == sum(d["output_lens"])
    dur = d["duration"]
    assert dur > 0 and d["request_throughput"] == pytest.approx(d["completed"] / dur)
    assert d["output_throughput"] == pytest.approx(d["total_output_tokens"] / dur)
    assert d["total_token_throughput"] == pytest.approx((d["total_input_tokens"] + d["total_output_tokens"]) / dur)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        values = [d[f"{p}_{metric}_ms"] for p in PERCENTILE_KEYS]
        assert values == sorted(values) and values[0] > 0, (metric, values)
        assert d[f"median_{metric}_ms"] == pytest.approx(values[0])
        assert d[f"mean_{metric}_ms"] > 0 and d[f"std_{metric}_ms"] >= 0
    assert d["mean_ttft_ms"] < d["mean_e2el_ms"] <= 1000 * dur + 1
    assert max(d["e2els"]) <= dur
    # one gap per text chunk after the first: at most output tokens - 1
    assert all(1 <= len(itl) <= n - 1 for itl, n in zip(d["itls"], d["output_lens"], strict=True))
    assert 1 <= d["max_concurrent_requests"] <= num_prompts
    s = d["server_metrics"]
    assert s is not None and s["num_scrapes"] >= 2
    assert 0 < s["peak_kv_cache_usage_perc"] <= 1
    assert s["num_preemptions"] == 0
    assert 0 <= s["prefix_cache_hit_rate"] <= 1
    assert s["mean_queue_time_ms"] >= 0


def test_bench_dataset_chat(server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": n}) for p, n in PROMPTS))
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    # an OpenAI-client style base URL (…/v1) and a concurrency cap of 1: requests run one at a time while /metrics
    # is polled on its own connection, so the server's peak running count is 1 and it was seen
    proc = bench("--base-url", server.url + "/v1", "--api-key", API_KEY, "--dataset", str(data), "--num-prompts",
                 "4", "--request-rate", "20", "--max-concurrency", "1", "--goodput", "ttft:60000", "tpot:60000",
                 "--result-json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout and "Peak KV cache usage" in proc.stdout
    d = json.loads(out.read_text())
    assert d["model_id"] == server.model  # the first id of /v1/models
    assert d["request_rate"] == 20.0 and d["endpoint_type"] == "chat"
    check_run(d, 4)
    assert sorted(d["output_lens"]) == sorted(n for _, n in PROMPTS)  # ignore_eos: exactly max_tokens each
    assert all(n > 5 for n in d["input_lens"])  # the server's usage: chat template included
    assert d["request_goodput"] == pytest.approx(d["request_throughput"])  # generous SLOs: every request is good
    assert d["slo_attainment"] == 1.0
    assert d["max_concurrent_requests"] == 1 and d["server_metrics"]["peak_num_requests_running"] == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_workload_sweep_completions(server, tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    proc = bench("--base-url", server.url, "--api-key", API_KEY, "--workload", "customer-service", "--num-prompts",
                 "1", "--endpoint", "completions", "--sweep", "4,inf", "--goodput", "ttft:1", "--result-json",
                 str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [r["request_rate"] for r in d["summary"]] == [4.0, "inf"]
    assert d["max_sustained_rate"] is None and d["slo_attainment_goal"] == 0.9
    assert "max sustained rate (SLO attainment >= 90% up to it): none of the swept rates" in proc.stdout
    for run in d["runs"]:
        check_run(run, 1)
        assert run["endpoint_type"] == "completions"
        assert run["request_goodput"] == 0.0 and run["slo_attainment"] == 0.0  # no first token within 1 ms
        assert 200 <= run["input_lens"][0] <= 500 and 20 <= run["output_lens"][0] <= 80  # the scenario's ranges
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_bad_arguments(server):
    proc = bench("--base-url", server.url, "--goodput", "latency:5")
    assert proc.returncode == 2 and "goodput" in proc.stderr
    proc = bench("--base-url", server.url, "--sweep", "1", "--slo-attainment-goal", "1.5")
    assert proc.returncode == 2 and "--slo-attainment-goal must be in (0, 1]" in proc.stderr
    proc = bench("--base-url", server.url, "--max-concurrency", "0")
    assert proc.returncode == 2 and "--max-concurrency must be >= 1" in proc.stderr
    proc = bench("--base-url", server.url, "--sweep", "1", "--request-rate", "2")
    assert proc.returncode == 2 and "not allowed with" in proc.stderr
