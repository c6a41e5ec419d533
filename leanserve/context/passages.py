"""RAG passages under a token budget: de-duplication, BM25 ranking, selection, "lost in the middle" reorder, and
the prompt built with the chat template.

- **Duplicates** (:func:`deduplicate`): texts equal after normalization (case, whitespace) are exact duplicates;
  texts whose sets of word 3-shingles have a Jaccard similarity >= ``threshold`` (default 0.5) are
  near duplicates (Broder, "On the resemblance and containment of documents", 1997). The Jaccard similarity is
  computed exactly over all pairs: requests carry tens of passages, where exact beats a MinHash estimate at no
  real cost. The first of each group (in request order, which is the retriever's) is kept.
- **Ranking** (:func:`bm25_scores`): Okapi BM25 with k1 = 1.5, b = 0.75 and the non-negative idf
  ``ln(1 + (N - n + 0.5) / (n + 0.5))`` (Robertson & Zaragoza, "The Probabilistic Relevance Framework: BM25 and
  Beyond", 2009, eq. 3.4, with Lucene's +1 inside the log), over lower-cased alphanumeric words minus a small
  English stop-word list. The query is the last user message.
- **Selection** (:func:`select_passages`): by score (ties: request order), at most ``top_k``, then greedily
  while the passages' tokens fit ``max_context_tokens`` (a passage that does not fit is skipped, a smaller one
  after it may still fit).
- **Reorder** (:func:`lost_in_the_middle`): the most relevant at both ends (Liu et al., "Lost in the Middle: How
  Language Models Use Long Contexts", 2023): ranks 1, 3, 5, ... from the start, then ..., 6, 4, 2 to the end.
- **Prompt** (:func:`build_messages`): a template that renders ``documents`` itself gets them as the
  ``documents`` variable; otherwise they are written into the last user message, before the question, as
  ``[id] text`` blocks.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from leanserve.errors import InvalidParameterError

K1, B = 1.5, 0.75
NEAR_DUPLICATE_THRESHOLD = 0.5
SHINGLE = 3
DOCUMENTS_HEADER = "Use the following documents to answer. Cite them by their [id]."
_WORD = re.compile(r"[a-z0-9]+")
STOP_WORDS = frozenset(
    "a an and are as at be but by for from has have how i in is it its of on or that the their this to was "
    "were what when where which who why will with you your does do did can".split())


@dataclass(frozen=True)
class Passage:
    id: str
    text: str


@dataclass
class PassageSelection:
    """What :func:`select_passages` chose.

    Attributes:
        used: the passages sent to the model, in prompt order (after the reorder, if any).
        duplicates: id -> the id of the kept passage it duplicates (exact or near).
        dropped: ids left out by ``top_k`` or the token budget (not duplicates), in rank order.
        scores: id -> BM25 score, for every non-duplicate passage.
        num_tokens: tokens of the used passages' blocks; ``num_tokens_sent``: of all passages' blocks.
    """

    used: list[Passage]
    duplicates: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)
    num_tokens: int = 0
    num_tokens_sent: int = 0

    @property
    def used_ids(self) -> list[str]:
        return [p.id for p in self.used]


def as_passages(documents: Sequence[Any]) -> list[Passage]:
    """``[{"id", "text"}]`` (or Passage objects) as Passages.

    Raises:
        InvalidParameterError("documents"): not a list, an entry without a string ``id`` and ``text``, or two
            entries with the same id.
    """
    if not isinstance(documents, list | tuple):
        raise InvalidParameterError("documents", "documents must be a list of {\"id\", \"text\"} objects")
    out = []
    for i, d in enumerate(documents):
        if isinstance(d, Passage):
            out.append(d)
            continue
        if not isinstance(d, dict) or not isinstance(d.get("id"), str) or not isinstance(d.get("text"), str):
            raise InvalidParameterError("documents", f"documents[{i}] must be an object with a string id and text")
        out.append(Passage(d["id"], d["text"]))
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        dup = next(x for x in ids if ids.count(x) > 1)
        raise InvalidParameterError("documents", f"document ids must be unique; {dup!r} appears twice")
    return out


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(text: str, k: int = SHINGLE) -> frozenset[tuple[str, ...]]:
    """The set of ``k``-word shingles of ``text`` (its words if it has fewer than k)."""
    w = words(text)
    if len(w) < k:
        return frozenset({tuple(w)}) if w else frozenset()
    return frozenset(tuple(w[i:i + k]) for i in range(len(w) - k + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def deduplicate(passages: Sequence[Passage], threshold: float = NEAR_DUPLICATE_THRESHOLD
                ) -> tuple[list[Passage], dict[str, str]]:
    """(the passages without duplicates, in order; duplicate id -> kept id). See the module docstring."""
    kept: list[Passage] = []
    kept_norm: dict[str, str] = {}
    kept_sh: list[frozenset] = []
    duplicates: dict[str, str] = {}
    for p in passages:
        norm = " ".join(p.text.lower().split())
        if norm in kept_norm:
            duplicates[p.id] = kept_norm[norm]
            continue
        sh = shingles(p.text)
        match = next((kept[j].id for j, s in enumerate(kept_sh) if jaccard(sh, s) >= threshold), None)
        if match is not None:
            duplicates[p.id] = match
            continue
        kept.append(p)
        kept_norm[norm] = p.id
        kept_sh.append(sh)
    return kept, duplicates


def bm25_scores(query: str, texts: Sequence[str], k1: float = K1, b: float = B) -> list[float]:
    """Okapi BM25 score of each text for ``query`` (formula in the module docstring)."""
    docs = [[w for w in words(t) if w not in STOP_WORDS] for t in texts]
    q = [w for w in words(query) if w not in STOP_WORDS]
    n_docs = len(docs)
    if not n_docs:
        return []
    avgdl = sum(len(d) for d in docs) / n_docs or 1.0
    df = Counter(w for d in docs for w in set(d))
    scores = []
    for d in docs:
        tf = Counter(d)
        s = 0.0
        for w in q:
            f = tf.get(w, 0)
            if not f:
                continue
            idf = math.log(1.0 + (n_docs - df[w] + 0.5) / (df[w] + 0.5))
            s += idf * f * (k1 + 1) / (f + k1 * (1 - b + b * len(d) / avgdl))
        scores.append(s)
    return scores


def lost_in_the_middle(items: Sequence[Any]) -> list[Any]:
    """Items given best first, reordered so the best sit at both ends: [1, 3, 5, ..., 6, 4, 2]."""
    return list(items[0::2]) + list(items[1::2])[::-1]


def passage_block(p: Passage) -> str:
    return f"[{p.id}] {p.text}"


def select_passages(query: str, documents: Sequence[Any], tokenizer: Any = None, *,
                    max_context_tokens: int | None = None, top_k: int | None = None, reorder: bool = True,
                    deduplicate_near: bool = True, threshold: float = NEAR_DUPLICATE_THRESHOLD) -> PassageSelection:
    """De-duplicate, rank by BM25 against ``query``, keep the best under ``top_k`` / ``max_context_tokens``
    (tokens of each ``[id] text`` block by ``tokenizer.encode(..., add_special_tokens=False)``; a tokenizer is
    needed only with ``max_context_tokens``), optionally reorder. See the module docstring.

    Raises:
        InvalidParameterError: bad ``documents`` (:func:`as_passages`), ``top_k`` < 1 or ``max_context_tokens``
            < 1 (param names ``top_k_documents`` and ``max_context_tokens``), or a budget without a tokenizer.
    """
    passages = as_passages(documents)
    for name, value in (("top_k_documents", top_k), ("max_context_tokens", max_context_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidParameterError(name, f"{name} must be an integer >= 1, got {value!r}")
    if max_context_tokens is not None and tokenizer is None:
        raise InvalidParameterError("max_context_tokens", "max_context_tokens needs a tokenizer")
    unique, duplicates = deduplicate(passages, threshold if deduplicate_near else math.inf)
    scores = bm25_scores(query, [p.text for p in unique])
    order = sorted(range(len(unique)), key=lambda i: (-scores[i], i))
    ntok: dict[str, int] = {}

    def cost(p: Passage) -> int:
        if p.id not in ntok:
            ntok[p.id] = len(tokenizer.encode(passage_block(p), add_special_tokens=False)) if tokenizer else 0
        return ntok[p.id]

    chosen: list[Passage] = []
    dropped: list[str] = []
    used_tokens = 0
    for i in order:
        p = unique[i]
        if top_k is not None and len(chosen) >= top_k:
            dropped.append(p.id)
            continue
        if max_context_tokens is not None and used_tokens + cost(p) > max_context_tokens:
            dropped.append(p.id)
            continue
        chosen.append(p)
        used_tokens += cost(p)
    sent = sum(cost(p) for p in passages) if tokenizer is not None else 0
    if tokenizer is not None:
        used_tokens = sum(cost(p) for p in chosen)
    return PassageSelection(lost_in_the_middle(chosen) if reorder else chosen, duplicates, dropped,
                            {p.id: scores[i] for i, p in enumerate(unique)}, used_tokens, sent)


def template_renders_documents(tokenizer: Any) -> bool:
    """Whether the model's chat template uses the ``documents`` variable (then it lays the passages out)."""
    source = getattr(tokenizer, "chat_template", None) or ""
    return "documents" in source


def build_messages(messages: Sequence[dict[str, Any]], passages: Sequence[Passage], tokenizer: Any = None,
                   header: str = DOCUMENTS_HEADER) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, template kwargs) carrying ``passages``: as the template's ``documents`` variable when the
    template renders them, else written into the last user message before its text."""
    msgs = [dict(m) for m in messages]
    if not passages:
        return msgs, {}
    if tokenizer is not None and template_renders_documents(tokenizer):
        return msgs, {"documents": [{"id": p.id, "title": p.id, "text": p.text} for p in passages]}
    users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
    if not users:
        raise InvalidParameterError("documents", "documents need a user message (the query)")
    last = msgs[users[-1]]
    blocks = "\n\n".join(passage_block(p) for p in passages)
    last["content"] = f"{header}\n\n{blocks}\n\n{message_text(last)}"
    return msgs, {}


def message_text(message: dict[str, Any]) -> str:
    """A message's content as one string (text parts joined)."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def last_user_text(messages: Sequence[dict[str, Any]]) -> str:
    """The text of the last user message (the query), "" if none."""
    for m in reversed(messages):
        if m.get("role") == "user":
            return message_text(m)
    return ""
