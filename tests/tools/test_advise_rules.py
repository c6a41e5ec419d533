"""The advisor's rule table on synthetic snapshots: one per situation of the issue, each expecting its advice
first, and the degradation when metrics are missing (another engine's server, no /metrics at all)."""

from __future__ import annotations

from leanserve.config import EngineConfig
from leanserve.tools import advise_thresholds as th
from leanserve.tools.advise_rules import RULES, recommend
from leanserve.tools.advise_setup import Setup
from leanserve.tools.advise_snapshot import Dist, Snapshot, fill_unseen

import pytest

from tests.tools.advise_fixtures import dist, healthy

DEFAULTS = Setup()


def ids(recs) -> list[str]:
    return [r.id for r in recs]


def test_rule_table_is_data_in_the_seed_order():
    assert len({r.id for r in RULES}) == len(RULES)
    assert all(1 <= r.step <= 7 and r.when and r.source for r in RULES)
    assert [r.id for r in RULES if r.fallback] == ["slo-miss", "no-change"]  # run only when nothing else fires
    regular = [r.step for r in RULES if not r.fallback]
    assert regular == sorted(regular)  # the table reads in the seed's order
    assert set(th.STEPS) == set(range(1, 8))


def test_long_prompts_low_prefix_hits_advise_context_first():
    s = healthy(prompt_tokens=dist(2250, 2200, 2950), prefix_cache_hit_rate=0.05, prefill_ms=dist(3600),
                ttft_ms=dist(3900, 3700, 8000), queue_ms=dist(300), prefill_share=0.7, output_tokens=dist(175),
                prefill_tokens_per_s=594.0)
    recs = recommend(s, DEFAULTS)
    top = recs[0]
    assert (top.id, top.step) == ("context-too-long", 2)
    assert top.evidence["mean_prompt_tokens"] == 2250 and top.evidence["prefix_cache_hit_rate_pct"] == 5.0
    assert top.evidence["mean_prefill_ms"] == 3600 and top.evidence["p50_ttft_ms"] == 3700
    # halving the prompt halves at least the prefill: 1,800 of 3,600 ms; p50 TTFT 3,700 -> 1,900 ms
    assert "~1800 ms of the 3600 ms mean" in top.expected_effect and "3700 -> ~1900 ms" in top.expected_effect
    assert "594 computed tokens/s" in top.basis and "cut the answer" in top.risk
    assert top.serve_changes is None  # a client-side change: nothing for --experiment to try
    assert "slo-miss" not in ids(recs)  # a rule explains the slow TTFT


def test_queue_dominating_ttft_with_kv_not_full_advises_more_sequences():
    s = healthy(queue_ms=dist(2500), ttft_ms=dist(3000, 2800, 6000), kv_usage_peak=0.4, running_peak=8,
                waiting_peak=12)
    setup = Setup(EngineConfig(max_num_seqs=8), known=True)
    top = recommend(s, setup)[0]
    assert (top.id, top.step) == ("queue-bound", 4)
    assert top.evidence["queue_share_of_ttft_pct"] == pytest.approx(83.3)
    assert top.evidence["peak_running"] == 8 and top.evidence["peak_waiting"] == 12
    # twice the cap at least, and room for everyone seen at the peak: next power of two >= 8 + 12
    assert top.serve_changes == {"max_num_seqs": 32} and top.change.endswith("--max-num-seqs 32")
    assert top.target == ("mean_ttft_ms", "lower") and "TPOT" in top.risk


def test_queue_with_batch_below_cap_advises_capacity_not_a_flag():
    s = healthy(queue_ms=dist(2500), ttft_ms=dist(3000), kv_usage_peak=0.4, running_peak=3, waiting_peak=12)
    top = recommend(s, DEFAULTS)[0]  # leanserve's default cap, 64, assumed and named
    assert top.id == "queue-bound" and top.serve_changes is None
    assert "replica" in top.change and "--serve-args" in top.basis and "< --max-num-seqs 64" in top.basis


def test_kv_full_with_preemptions_advises_kv_dtype_first():
    s = healthy(kv_usage_peak=0.98, kv_usage_mean=0.9, preemptions=14, waiting_peak=6, queue_ms=dist(1500),
                ttft_ms=dist(2000))
    recs = recommend(s, Setup(max_model_len=8192))
    top = recs[0]
    assert (top.id, top.step) == ("kv-pressure", 6)
    assert "queue-bound" not in ids(recs)  # the queue is a symptom of the full cache here
    assert top.serve_changes == {"kv_cache_dtype": "float16"} and "--kv-cache-dtype float16" in top.change
    assert top.evidence["preemptions"] == 14 and top.evidence["peak_kv_usage_pct"] == 98.0
    assert "2.00x the tokens" in top.expected_effect and "near 49% instead of 98%" in top.expected_effect
    alternatives = " ".join(top.alternatives)
    assert "--max-model-len 1024" in alternatives and "--quantization" in alternatives  # p99 480 + 79 tokens
    # the next step down from each KV dtype
    assert recommend(s, Setup(EngineConfig(kv_cache_dtype="float16"), True))[0].serve_changes == {
        "kv_cache_dtype": "int8"}
    assert recommend(s, Setup(EngineConfig(kv_cache_dtype="int8", kv_cache_memory=1 << 30), True))[0] \
        .serve_changes == {"kv_cache_memory": 2 << 30}


def test_long_outputs_at_low_concurrency_advise_speculation():
    s = healthy(output_tokens=dist(550, 540, 790), mean_concurrency=1.5, prefill_share=0.03, decode_ms=dist(11000),
                tpot_ms=dist(20, 20, 22))
    top = recommend(s, DEFAULTS)[0]
    assert (top.id, top.step) == ("speculation", 7)
    assert top.evidence["mean_output_tokens"] == 550 and top.evidence["decode_share_pct"] == 97.0
    assert "--speculative-config" in top.change
    assert "2.31 tokens instead of 1" in top.expected_effect  # (1 - 0.6^5) / (1 - 0.6)
    assert "spare compute" in top.risk


def test_many_repeated_requests_advise_an_answer_cache():
    s = healthy(prefix_cache_hit_rate=0.93, requests=40)
    top = recommend(s, DEFAULTS)[0]
    assert (top.id, top.step) == ("answer-cache", 7)
    assert top.evidence["prefix_cache_hit_rate_pct"] == 93.0 and top.evidence["requests"] == 40
    assert "temperature" in top.change and "deterministic" in top.risk


def test_idle_and_healthy_servers_need_no_change():
    empty = Dist(None, None, None, 0, exact=False)
    idle = healthy(requests=0, request_throughput=0.0, output_throughput=0.0, prompt_throughput=0.0, ttft_ms=empty,
                   queue_ms=empty, prefill_ms=empty, decode_ms=empty, tpot_ms=empty, itl_ms=empty, e2el_ms=empty,
                   prompt_tokens=empty, output_tokens=empty, prefill_share=None, kv_usage_peak=0.0, running_peak=0,
                   mean_concurrency=None, prefix_cache_hit_rate=None)
    (rec,) = recommend(idle, DEFAULTS)
    assert rec.id == "no-change" and rec.title.startswith("idle") and rec.evidence["requests"] == 0
    (rec,) = recommend(healthy(), DEFAULTS)
    assert rec.id == "no-change" and rec.title.startswith("healthy") and rec.change == "none"


def test_over_the_slos_without_a_cause_asks_for_a_sweep():
    (rec,) = recommend(healthy(ttft_ms=dist(2500, 2400, 5000)), DEFAULTS)
    assert rec.id == "slo-miss" and "--sweep" in rec.change and rec.evidence["p99_ttft_ms"] == 5000
    assert rec.alternatives == []  # prefill is 380 of 2,500 ms: not where the time goes
    (rec,) = recommend(healthy(ttft_ms=dist(2200, 1900, 2900), prefill_ms=dist(1850), prefill_tokens_per_s=117.0),
                       DEFAULTS)
    assert rec.evidence["prefill_share_of_ttft_pct"] == 84.1 and "--threads below the core count" in \
        rec.alternatives[0] and "117 computed tokens/s" in rec.alternatives[0]


def test_flags_from_serve_args_drive_prefix_cache_and_quantization_advice():
    setup = Setup(EngineConfig(enable_prefix_caching=False, quantization="none"), known=True)
    recs = recommend(healthy(prefix_cache_hit_rate=0.0), setup)
    assert ids(recs) == ["prefix-cache-off", "quantize-weights"]
    assert recs[0].serve_changes == {"enable_prefix_caching": True}
    quant = recs[1]
    assert quant.serve_changes == {"quantization": "auto"} and "leanserve eval" in quant.change
    assert "--max-drop 0.05" in quant.change and "35.2 -> 137.0 tok/s (3.9x)" in quant.expected_effect
    assert "math and code" in quant.risk
    assert recommend(healthy(), Setup(EngineConfig(quantization="auto"), known=True))[0].id == "no-change"


def test_low_acceptance_advises_fewer_draft_tokens():
    top = recommend(healthy(spec_acceptance_rate=0.3), DEFAULTS)[0]
    assert top.id == "spec-low-acceptance" and "1.43 tokens per pass" in top.expected_effect


def test_llama_server_metrics_degrade_gracefully():
    """llama-server's /metrics: throughputs, slots and the prefill/decode split, no latency histograms."""
    s = fill_unseen(Snapshot(server_kind="llama.cpp", scope="window", window_s=10.0, prompt_throughput=310.0,
                             output_throughput=42.0, prefill_share=0.6, prefill_tokens_per_s=190.0, running_peak=4,
                             waiting_peak=2, mean_concurrency=3.2, kv_usage_peak=None))
    recs = recommend(s, DEFAULTS)
    assert ids(recs) == ["missing-metrics", "framework"]
    blind = recs[0].evidence["cannot_see"]
    for what in ("TTFT distribution", "queue time", "preemptions", "prefix-cache hit rate", "KV-cache usage"):
        assert what in blind
    assert "leanserve bench" in recs[0].change and "--metrics" in recs[0].expected_effect
    assert recs[1].serve_changes == {} and "2.67x" in recs[1].expected_effect


def test_no_metrics_at_all_still_advises_measuring():
    (rec,) = recommend(fill_unseen(Snapshot()), DEFAULTS)
    assert rec.id == "missing-metrics" and "no /metrics" in rec.expected_effect
