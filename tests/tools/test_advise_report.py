"""The advisor's outputs: the terminal table, the JSON document and the one-page HTML report with embedded plots."""

from __future__ import annotations

import base64
import json
import re

from leanserve.tools.advise_experiment import Experiment, compare
from leanserve.tools.advise_report import format_text, payload, write_html
from leanserve.tools.advise_rules import recommend
from leanserve.tools.advise_setup import Setup
from leanserve.tools.advise_snapshot import Snapshot, fill_unseen

from tests.tools.advise_fixtures import dist, healthy

SETUP = Setup(base_url="http://127.0.0.1:8000")


def queued():
    return healthy(queue_ms=dist(2500), ttft_ms=dist(3000, 2800, 6000), kv_usage_peak=0.4, running_peak=3,
                   waiting_peak=12, kv_series=[[0.0, 0.1], [0.5, 0.3], [1.0, 0.4]],
                   ttft_buckets=[[100.0, 0.0], [2500.0, 5.0], [5000.0, 10.0], [float("inf"), 5.0]])


def experiment() -> Experiment:
    before = {"mean_ttft_ms": 3000.0, "p99_ttft_ms": 6000.0, "output_throughput": 30.0, "failed": 0}
    after = {"mean_ttft_ms": 900.0, "p99_ttft_ms": 1500.0, "output_throughput": 33.0, "failed": 0}
    return Experiment("queue-bound", ["--max-num-seqs", "32"], ["--max-num-seqs", "32"], "customer-service", 16,
                      "inf", ["mean_ttft_ms", "lower"], compare(before, after), True,
                      "queue-bound (--max-num-seqs 32): helped: mean_ttft_ms 3000 -> 900 (+70.0% better)")


def test_text_report_is_a_compact_table_then_the_ranked_advice():
    s = queued()
    text = format_text(s, recommend(s, SETUP), SETUP, [experiment()])
    assert text.splitlines()[0] == "leanserve advise: http://127.0.0.1:8000 (leanserve, SmolLM2-135M-Instruct.Q4_1, " \
                                   "max_model_len 8192)"
    assert re.search(r"TTFT mean \| p50 \| p99 \(ms\)\s+3,000 \| 2,800 \| 6,000\s+-", text)
    assert re.search(r"queue share of TTFT\s+83.3%", text)
    assert re.search(r"prefix-cache hit rate\s+40.0%", text)
    assert "1. [step 4] queue-bound:" in text and "   change    another `leanserve serve` replica" in text
    assert re.search(r"mean TTFT \(ms\)\s+3,000.00\s+900.00\s+-70.0%", text)
    assert "verdict   queue-bound (--max-num-seqs 32): helped" in text
    assert max(len(line) for line in text.splitlines()) <= 140


def test_json_has_metrics_and_ranked_recommendations_with_the_issue_keys():
    s = queued()
    doc = json.loads(json.dumps(payload(s, recommend(s, SETUP), SETUP, [experiment()]), default=str))
    assert doc["metrics"]["queue_ms"]["mean"] == 2500 and doc["metrics"]["queue_share_of_ttft"] > 0.8
    (rec,) = doc["recommendations"]
    assert {"id", "step", "evidence", "change", "expected_effect", "risk"} <= set(rec) and rec["step"] == 4
    assert doc["experiments"][0]["helped"] is True and doc["setup"]["known"] is False
    assert {r["id"] for r in doc["rules"]} >= {"context-too-long", "kv-pressure", "speculation", "answer-cache"}


def test_html_is_one_page_with_embedded_plots(tmp_path):
    s = queued()
    path = write_html(tmp_path / "r" / "advise.html", s, recommend(s, SETUP), SETUP, [experiment()])
    html = path.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 3  # latency (TTFT and its parts), KV over the window, the experiment's before/after
    assert all(base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n" for img in images)
    assert "queue-bound" in html and "helped" in html and "--max-num-seqs 32" in html


def test_reports_degrade_with_nothing_to_read(tmp_path):
    s = fill_unseen(Snapshot())
    recs = recommend(s, SETUP)
    text = format_text(s, recs, SETUP)
    assert "read: nothing" in text and "cannot see: TTFT distribution" in text and "missing-metrics" in text
    html = write_html(tmp_path / "empty.html", s, recs, SETUP).read_text()
    assert "data:image/png" not in html and "Cannot see" in html
