"""The semantic cache's matching on its test set (semantic_pairs.py): paraphrases should hit, near-misses that
differ in a negation, a number, a named entity or the object must not. Both rates are printed (``-s``) and the
false-hit rate is held to <= 1%."""

from __future__ import annotations

from leanserve.context.semantic import (
    DEFAULT_THRESHOLD,
    SemanticIndex,
    WordLlamaEmbedder,
    guard_signature,
    guards_match,
    query_signature,
)

import numpy as np
import pytest
from semantic_pairs import NEAR_MISSES, PARAPHRASES


@pytest.fixture(scope="module")
def embedder():
    return WordLlamaEmbedder()


@pytest.mark.parametrize(("text", "sig"), [
    ("Can I return an item after 30 days?", (("30",), (), (), ("after",))),
    ("Can't I return it after thirty days?", (("30",), ("after days return thirty",), (), ("after",))),
    ("Do you ship to Canada's north, not Mexico?", ((), ("mexico",), ("canada", "mexico"), ())),
    ("Is version 3.2 on the iPhone?", (("3.2",), (), ("iphone",), ("on",))),
    ("Paris is nice. I never went.", ((), ("went",), (), ())),  # the first word and "I" are not entities
])
def test_guard_signature(text, sig):
    assert guard_signature(text) == sig


@pytest.mark.parametrize(("a", "b"), [
    ("Can I return it after 30 days?", "Can I return it within 30 days?"),
    ("Can I cancel after shipping?", "Can I cancel before shipping?"),
    ("Is the heater turned on?", "Is the heater turned off?"),
    ("How many items at most?", "How many items at least?"),
    # what a negation applies to, not only whether there is one (a fresh-user trial's false hits)
    ("Can I not return my parcel?", "Can I return my parcel? I don't need it."),
    ("Can I not return my parcel?", "Can I return my parcel, yes or no?"),
    ("Can I return my parcel?", "Can I return my parcel once?"),
    ("Can I cancel my order?", "Can I cancel my order immediately?"),
])
def test_opposite_words_keep_questions_apart(a, b):
    assert not guards_match(query_signature(a), query_signature(b))


def test_an_added_qualifier_keeps_questions_apart_a_replaced_word_does_not():
    assert not guards_match(query_signature("How can I reset my password?"),
                            query_signature("How can I reset my email password?"))
    assert guards_match(query_signature("How do I reset my password?"),
                        query_signature("How can I change my password?"))


def test_embeddings_are_unit_vectors(embedder):
    v = embedder.embed(["How do I reset my password?", "Where is my order?"])
    assert v.shape == (2, 256) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)


def rates(embedder, threshold: float) -> tuple[float, float]:
    def hits(pairs):
        n = 0
        for cached, new in pairs:
            index = SemanticIndex()
            va, vb = embedder.embed([cached, new])
            index.add(b"entry", b"ctx", va, query_signature(cached))
            n += index.match(b"ctx", vb, query_signature(new), threshold) is not None
        return n / len(pairs)

    return hits(PARAPHRASES), hits(NEAR_MISSES)


def test_false_hits_at_most_1_percent_and_paraphrase_rate_reported(embedder):
    para, false = rates(embedder, DEFAULT_THRESHOLD)
    print(f"\nsemantic cache at similarity {DEFAULT_THRESHOLD}: paraphrase hit rate {para:.1%} "
          f"({len(PARAPHRASES)} pairs), near-miss false-hit rate {false:.1%} ({len(NEAR_MISSES)} pairs)")
    assert false <= 0.01
    assert para >= 0.8


def test_index_keeps_contexts_apart_and_is_bounded(embedder):
    index = SemanticIndex(max_entries=2)
    q = "How do I reset my password?"
    v = embedder.embed([q])[0]
    index.add(b"e1", b"ctx-a", v, query_signature(q))
    assert index.match(b"ctx-b", v, query_signature(q), 0.5) is None  # another system prompt / parameters
    assert index.match(b"ctx-a", v, query_signature(q), 0.5)[0] == b"e1"
    index.add(b"e2", b"ctx-a", v, query_signature(q))
    index.add(b"e3", b"ctx-b", v, query_signature(q))
    assert len(index) == 2 and index.match(b"ctx-a", v, query_signature(q), 0.5)[0] == b"e2"
