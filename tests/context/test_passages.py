"""Passage selection: duplicates, BM25 (against a hand computation), budget / top-k, the reorder, the prompt."""

from __future__ import annotations

import math

from leanserve.context import bm25_scores, build_messages, deduplicate, lost_in_the_middle, select_passages
from leanserve.context.passages import Passage, jaccard, shingles
from leanserve.errors import InvalidParameterError

import pytest
from fake_tokenizer import WordTokenizer

DOCS = [
    {"id": "eiffel", "text": "The Eiffel Tower is in Paris and was built in 1889 for the World Fair."},
    {"id": "capital", "text": "Paris is the capital of France."},
    {"id": "capital-copy", "text": "  PARIS is the   capital of France. "},  # exact duplicate (case, spaces)
    {"id": "eiffel-near", "text": "The Eiffel Tower is in Paris, and it was built in 1889 for the World Fair."},
    {"id": "london", "text": "The Tower of London is a castle by the Thames."},
    {"id": "louvre", "text": "The Louvre in Paris is the most visited museum in the world."},
]
QUERY = "When was the Eiffel Tower built?"


def test_jaccard_of_the_near_duplicate():
    a, b = shingles(DOCS[0]["text"]), shingles(DOCS[3]["text"])
    # 15 words -> 13 shingles; 16 words -> 14; 11 shared (all but "paris and was" and "and was built")
    assert (len(a), len(b), len(a & b)) == (13, 14, 11)
    assert jaccard(a, b) == pytest.approx(11 / 16)


def test_deduplicate_keeps_the_first_of_each_group():
    kept, dups = deduplicate([Passage(d["id"], d["text"]) for d in DOCS])
    assert [p.id for p in kept] == ["eiffel", "capital", "london", "louvre"]
    assert dups == {"capital-copy": "capital", "eiffel-near": "eiffel"}


def test_bm25_matches_the_formula():
    texts = ["tower tower paris", "paris museum", "castle"]
    # query terms after stop words: tower, built ("when", "was", "the" are stop words)
    n, avgdl = 3, (3 + 2 + 1) / 3
    idf = math.log(1 + (n - 1 + 0.5) / (1 + 0.5))  # "tower" is in one text; "built" in none
    tf, dl = 2, 3
    expected = idf * tf * 2.5 / (tf + 1.5 * (1 - 0.75 + 0.75 * dl / avgdl))
    assert bm25_scores(QUERY, texts) == pytest.approx([expected, 0.0, 0.0])


def test_selection_ranks_and_reports():
    sel = select_passages(QUERY, DOCS, reorder=False)
    # eiffel matches eiffel/tower/built, london matches tower; the rest tie at 0 in request order
    assert sel.used_ids == ["eiffel", "london", "capital", "louvre"]
    assert sel.duplicates == {"capital-copy": "capital", "eiffel-near": "eiffel"}
    assert sel.scores["eiffel"] > sel.scores["london"] > 0 == sel.scores["capital"] == sel.scores["louvre"]


def test_top_k_and_reorder():
    sel = select_passages(QUERY, DOCS, top_k=3)
    assert sel.used_ids == ["eiffel", "capital", "london"]  # ranks 1, 3, 2: the best two at the ends
    assert sel.dropped == ["louvre"]


def test_token_budget_skips_what_does_not_fit():
    tok = WordTokenizer()  # a block "[id] text" costs 1 + the words of the text
    costs = {d["id"]: 1 + len(d["text"].split()) for d in DOCS}
    assert (costs["eiffel"], costs["london"], costs["capital"], costs["louvre"]) == (16, 11, 7, 13)
    sel = select_passages(QUERY, DOCS, tok, max_context_tokens=25, reorder=False)
    assert sel.used_ids == ["eiffel", "capital"]  # 16; london (11) would make 27; capital (7) fits; louvre not
    assert sel.dropped == ["london", "louvre"] and sel.num_tokens == 23
    assert sel.num_tokens_sent == sum(1 + len(d["text"].split()) for d in DOCS)


@pytest.mark.parametrize(("items", "expected"), [
    ([1, 2, 3, 4, 5], [1, 3, 5, 4, 2]), ([1, 2, 3, 4], [1, 3, 4, 2]), ([1], [1]), ([], []), ([1, 2], [1, 2]),
])
def test_lost_in_the_middle(items, expected):
    assert lost_in_the_middle(items) == expected


def test_build_messages_puts_passages_before_the_question():
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": QUERY}]
    out, kwargs = build_messages(msgs, [Passage("a", "one"), Passage("b", "two")])
    assert kwargs == {} and out[0] == msgs[0] and msgs[1]["content"] == QUERY  # input untouched
    assert out[1]["content"].endswith("[a] one\n\n[b] two\n\n" + QUERY)


@pytest.mark.parametrize(("docs", "msg"), [
    ("not a list", "must be a list"), ([{"text": "no id"}], r"documents\[0\] must"),
    ([{"id": 3, "text": "x"}], r"documents\[0\] must"),
    ([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}], "unique"),
])
def test_bad_documents(docs, msg):
    with pytest.raises(InvalidParameterError, match=msg) as e:
        select_passages(QUERY, docs)
    assert e.value.param == "documents"


def test_bad_budgets():
    with pytest.raises(InvalidParameterError) as e:
        select_passages(QUERY, DOCS, top_k=0)
    assert e.value.param == "top_k_documents"
    with pytest.raises(InvalidParameterError) as e:
        select_passages(QUERY, DOCS, WordTokenizer(), max_context_tokens=-1)
    assert e.value.param == "max_context_tokens"


def test_max_prompt_tokens_keeps_the_best_ranked_passages_that_fit():
    """The passages sit in the pinned latest user turn: with max_prompt_tokens, the best-ranked ones that fit
    beside the pinned messages stay, the rest are reported dropped (was: a 400 that did not name them)."""
    from leanserve.context import prepare_chat
    from leanserve.errors import ContextLengthExceededError

    tok = WordTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": QUERY}]
    full = prepare_chat(msgs, tok, documents=DOCS, reorder_documents=False)
    ranked = full.documents_used  # eiffel, london, louvre, capital: best first
    assert ranked[0] == "eiffel" and full.documents_dropped == []
    bare = len(prepare_chat(msgs, tok).prompt_token_ids)
    header = len(prepare_chat(msgs, tok, documents=DOCS[:1]).prompt_token_ids) - bare - 16  # the header's words
    one = bare + header + 16  # "[eiffel]" + its 15 words
    for budget, kept in ((len(full.prompt_token_ids), 4), (one, 1), (one - 1, 0), (one + 6, 1)):
        out = prepare_chat(msgs, tok, documents=DOCS, reorder_documents=False, max_prompt_tokens=budget)
        assert out.documents_used == ranked[:kept] and out.documents_dropped == ranked[kept:], budget
        assert len(out.prompt_token_ids) <= budget
    with pytest.raises(ContextLengthExceededError, match="0 of the documents kept and 4 left out") as e:
        prepare_chat(msgs, tok, documents=DOCS, max_prompt_tokens=bare - 1)
    assert e.value.param == "max_prompt_tokens"
