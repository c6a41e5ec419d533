"""Workload generators: token lengths within each scenario's bounds, deterministic for a seed."""

from __future__ import annotations

from leanserve.bench.corpus import SOURCE_NOTE, docstring_passages
from leanserve.bench.workloads import SUPPORT_SYSTEM_PROMPT, WORKLOADS, make_workload

import pytest


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_lengths_within_bounds(name, corpus, tokenizer):
    spec = WORKLOADS[name]
    reqs = make_workload(name, corpus, 6, seed=0)
    assert len(reqs) == 6
    for r in reqs:
        assert spec.prompt_range[0] <= r.prompt_len <= spec.prompt_range[1]
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert spec.output_range[0] <= r.max_tokens <= spec.output_range[1]
        assert r.prompt == "\n\n".join(m["content"] for m in r.messages)
        assert r.messages[-1]["role"] == "user"
    # lengths are drawn over the range, not fixed
    assert len({r.prompt_len for r in reqs}) > 1 and len({r.max_tokens for r in reqs}) > 1


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_deterministic_for_a_seed(name, corpus):
    a = make_workload(name, corpus, 3, seed=7)
    assert a == make_workload(name, corpus, 3, seed=7)
    b = make_workload(name, corpus, 3, seed=8)
    assert [r.prompt for r in a] != [r.prompt for r in b]


def test_scenario_shapes(corpus):
    cs = make_workload("customer-service", corpus, 4, seed=0)
    assert all(r.messages[0] == {"role": "system", "content": SUPPORT_SYSTEM_PROMPT} for r in cs)
    assert all("Customer: " in r.messages[1]["content"] and "FAQ:" in r.messages[1]["content"] for r in cs)
    qa = make_workload("knowledge-qa", corpus, 8, seed=0)
    assert all("Document 1 [source:" in r.prompt and "\n\nQuestion: " in r.prompt for r in qa)
    assert any("(mirror)]" in r.prompt for r in qa)  # near-duplicate passages, as retrieval returns
    code = make_workload("code-assistant", corpus, 2, seed=0)
    assert all("```python\n" in r.prompt and (".py:" in r.prompt) for r in code)


def test_corpus_is_real_stdlib_text():
    passages = docstring_passages(max_total_chars=20_000)
    assert passages and all(len(p.text) >= 300 for p in passages)
    assert "PSF" in SOURCE_NOTE


def test_unknown_workload(corpus):
    with pytest.raises(KeyError, match="customer-service"):
        make_workload("chit-chat", corpus, 1)
