"""The target figures of benchmarks/compare_servers.py on hand-made sweep results with known answers."""

from __future__ import annotations

import pytest

from benchmarks.compare_servers import sustained_rates, targets


def run(rate: float | str, attainment: float, p99_ttft_ms: float = 1000.0, median_ttft_ms: float = 500.0) -> dict:
    return {"request_rate": rate, "slo_attainment": attainment, "completed": 16, "failed": 0,
            "p99_ttft_ms": p99_ttft_ms, "median_ttft_ms": median_ttft_ms,
            "request_goodput": None if rate == "inf" else attainment * rate}


def test_customer_service_targets():
    cs = {"leanserve": [run(0.5, 1.0), run(1.0, 1.0), run(2.0, 0.95), run(4.0, 0.5)],
          "llama.cpp": [run(0.5, 1.0, 1800), run(1.0, 0.6, 2900), run(2.0, 0.0, 8000), run(4.0, 0.0, 9000)]}
    t = targets({"customer-service": cs}, goal=0.9)["customer_service"]
    literal = t["at_llama_p99_ttft_limit"]  # llama-server keeps p99 TTFT < 2 s only at 0.5 req/s
    assert literal["rate"] == 0.5 and literal["goodput_ratio"] == pytest.approx(1.0)
    sustained = t["max_sustained_rate"]
    assert (sustained["leanserve"], sustained["llama.cpp"]) == (2.0, 0.5)
    assert sustained["ratio"] == pytest.approx(4.0) and sustained["lower_bounds"] == []
    assert t["met"]
    assert targets({"customer-service": cs}, goal=0.99)["customer_service"]["max_sustained_rate"]["ratio"] == 2.0


def test_no_sustained_rate_and_lower_bound():
    res = {"copywriting": {"leanserve": [run(0.1, 1.0), run("inf", 1.0)], "llama.cpp": [run(0.1, 0.5), run("inf", 0)]}}
    row = sustained_rates(res, goal=0.9)["copywriting"]
    assert row["leanserve"] == float("inf") and row["lower_bounds"] == ["leanserve"]
    assert row["llama.cpp"] is None and row["ratio"] is None


def test_knowledge_qa_target():
    kq = {"leanserve": [run(0.1, 0.0, median_ttft_ms=5000)], "llama.cpp": [run(0.1, 0.0, median_ttft_ms=20000)]}
    t = targets({"knowledge-qa": kq}, goal=0.9)["knowledge_qa"]
    assert t["per_rate"][0]["ratio"] == pytest.approx(0.25) and t["met_at_every_rate"]
