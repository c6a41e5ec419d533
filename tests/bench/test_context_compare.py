"""The context benchmarks' inputs (``leanserve bench --compare``): the QA set, the two request forms, the FAQ
draw; no server."""

from __future__ import annotations

from collections import Counter

from leanserve.bench.client import build_payload
from leanserve.bench.context_compare import faq_requests, qa_requests, qa_set, zipf_draw
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
