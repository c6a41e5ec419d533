"""The context benchmarks' inputs (``leanserve bench --compare``): the QA set, the two request forms, the FAQ
draw; no server."""

from __future__ import annotations

import io
from collections import Counter

from leanserve.bench.client import build_payload
from leanserve.bench.context_compare import customer_requests, faq_requests, qa_requests, qa_set, zipf_draw
from leanserve.context import select_passages


def test_qa_set_states_each_answer_in_one_passage(corpus):
    items = qa_set(corpus, 12, seed=0)
    assert items == qa_set(corpus, 12, seed=0)  # reproducible
    for passages, question, answer in items:
        assert len(passages) == 10 and len({p.id for p in passages}) == 10
        gold = [p for p in passages if answer in p.text]
        assert gold and any(p.id.startswith("doc-") for p in gold)
        # BM25 finds the gold passage among the hard negatives: it is in the top 3 the "on" variant keeps
        assert any(answer in p.text for p in select_passages(question, passages, top_k=3).used)


def test_off_pastes_every_passage_on_sends_documents(corpus):
    items = qa_set(corpus, 2, seed=1)
    off, on = qa_requests(items, corpus.count, top_k=3)
    passages, question, _ = items[0]
    assert all(f"[{p.id}] {p.text}" in off[0].messages[-1]["content"] for p in passages)
    assert off[0].messages[-1]["content"].endswith(question) and "documents" not in off[0].extra
    body = build_payload(on[0], "m", "chat")
    assert body["messages"][-1]["content"] == question and body["top_k_documents"] == 3
    assert [d["id"] for d in body["documents"]] == [p.id for p in passages] and body["ignore_eos"] is False
    assert off[0].prompt_len > 4 * on[0].prompt_len


def test_faq_draw_is_zipf(corpus):
    faqs = faq_requests(corpus, run=1)
    assert len({r.prompt for r in faqs}) == 50
    assert faq_requests(corpus, run=2)[0].prompt != faqs[0].prompt  # each run has its own (cold) prompts
    draw = zipf_draw(list(range(50)), 20000, 1.0, seed=0)
    counts = Counter(draw)
    h50 = sum(1 / k for k in range(1, 51))
    assert abs(counts[0] / 20000 - 1 / h50) < 0.01 and abs(counts[1] / 20000 - 0.5 / h50) < 0.01
    assert counts[0] > counts[9] > counts[49]


def test_customer_requests_mix_repeats_and_questions_of_their_own(corpus):
    faqs = faq_requests(corpus, run=3)
    reqs = customer_requests(faqs, 400, 1.0, 0.3, seed=0, count=corpus.count)
    assert reqs == customer_requests(faqs, 400, 1.0, 0.3, seed=0, count=corpus.count)  # reproducible
    faq_prompts = {r.prompt for r in faqs}
    unique = [r for r in reqs if r.prompt not in faq_prompts]
    assert 0.25 < len(unique) / len(reqs) < 0.35
    assert len({r.prompt for r in unique}) == len(unique)  # never the same twice
    assert all("My order number is" in r.messages[1]["content"] and r.prompt_len == corpus.count(r.prompt)
               for r in unique)
    assert all(r in faqs for r in reqs if r.prompt in faq_prompts)  # the others repeat their FAQ exactly
    assert customer_requests(faqs, 50, 1.0, 0.0, seed=0, count=corpus.count) == zipf_draw(faqs, 50, 1.0, seed=0)


def test_answer_cache_sweep_runs_off_and_on_back_to_back(corpus, monkeypatch):
    """At each rate off runs, then on (same machine load for both), each after its warm-up of one request per FAQ;
    each variant's sustained rate comes from its own attainments; hits are counted from the responses."""
    from types import SimpleNamespace

    from leanserve.bench import context_compare
    from leanserve.bench.runner import BenchConfig

    calls = []
    attainment = {("off", 2.0): 1.0, ("off", 4.0): 0.5, ("on", 2.0): 1.0, ("on", 4.0): 0.95}

    def fake_run(cfg, reqs, label, count_tokens):
        variant = "off" if "off" in label else "on"
        calls.append((variant, "warm-up" in label, cfg.request_rate, len(reqs), reqs[0].extra.get("cache")))
        results = [SimpleNamespace(answer_cache="hit" if variant == "on" and i % 2 else "miss")
                   for i in range(len(reqs))]
        metrics = SimpleNamespace(latency={"median_ttft_ms": 1.0, "p99_ttft_ms": 2.0}, failed=0,
                                  slo_attainment=attainment.get((variant, cfg.request_rate)))
        return SimpleNamespace(results=results, metrics=metrics)

    monkeypatch.setattr(context_compare, "run_benchmark", fake_run)
    flushed = []  # what stdout held at each flush: each rate's line goes out as that rate ends (redirected too)

    class Out(io.StringIO):
        def flush(self):
            flushed.append(self.getvalue())

    out = Out()
    monkeypatch.setattr(context_compare.sys, "stdout", out)
    rows = context_compare.compare_answer_cache(BenchConfig(base_url="http://x", slos={"ttft": 3000}), corpus,
                                                n=10, seed=0, rates=[2.0, 4.0], goal=0.9)
    assert flushed[0].endswith("answer cache off, rate 2.00 req/s: hit rate 0%, p50 TTFT 1 ms, p99 TTFT 2 ms, SLO "
                               "attainment 100%\n")
    assert len(flushed) >= 4 and "answer cache on, rate 4.00 req/s" in flushed[3] and "|" not in flushed[3]
    assert "| SLO attainment (TTFT <= 3 s) |" in out.getvalue()
    inf = float("inf")
    assert calls == [("off", True, inf, 50, False), ("off", False, 2.0, 10, False),
                     ("on", True, inf, 50, None), ("on", False, 2.0, 10, None),
                     ("off", True, inf, 50, False), ("off", False, 4.0, 10, False),
                     ("on", True, inf, 50, None), ("on", False, 4.0, 10, None)]
    assert rows["answer cache off"]["max_sustained_rate"] == 2.0
    assert rows["answer cache on"]["max_sustained_rate"] == 4.0
    assert [x["hit_rate"] for x in rows["answer cache on"]["runs"]] == [0.5, 0.5]
    assert [x["hit_rate"] for x in rows["answer cache off"]["runs"]] == [0.0, 0.0]
    calls.clear()
    context_compare.compare_answer_cache(BenchConfig(base_url="http://x", slos={"ttft": 3000}), corpus, n=10,
                                         seed=0, rates=[2.0], goal=0.9, warmup=False)
    assert [c[:2] for c in calls] == [("off", False), ("on", False)]
