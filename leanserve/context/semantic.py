"""The semantic answer cache's matching: an embedding of the new question against those of cached questions
asked in the same context, behind a lexical guard.

- **Embedding**: WordLlama (:class:`leanserve.embeddings.WordLlamaEmbedder`, re-exported here: the weights ship
  in the ``wordllama`` package, nothing is fetched at run time), cosine similarity of the L2-normalized vectors.
- **Guard** (:func:`guard_signature`): a bag-of-words embedding barely moves when one word changes, yet "after
  30 days" / "after 60 days", "can I" / "can't I" and "to Canada" / "to Mexico" need other answers. Two
  questions may match only if they have the same numbers (digits, and number words as digits), the same count of
  negations (not, no, never, without, n't, ...) and the same capitalized words after the first (named entities).
- **Match** (:class:`SemanticIndex`): the most similar cached question whose guard signature is equal and whose
  context key (everything else: system prompt, earlier turns, parameters) is the same, if its similarity is at
  least the threshold.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from leanserve.embeddings import WordLlamaEmbedder  # noqa: F401  (re-exported: its old home)

import numpy as np

NEGATIONS = frozenset("not no never none nobody nothing nowhere neither nor without cannot".split())
# Words whose opposite flips the answer while barely moving the embedding ("after / within 30 days", "turned on /
# off", "at most / at least"): they must match too.
POLARITY_WORDS = frozenset(
    "after before within since until during on off in out up down above below over under more less most least "
    "maximum minimum max min higher lower increase decrease enable disable start stop open close closed opened "
    "first last early late earlier later add remove include exclude buy sell "
    # qualifiers: how often, how soon, how many of them
    "once twice again immediately instantly always only every each all both".split())
# Words that carry no content of a question (pronouns, articles, auxiliaries, question words, fillers): left out of
# content_words, which a negation's scope and the added-modifier check compare.
_FUNCTION_WORDS = frozenset(
    "i you we they he she it me us them my your our their a an the to be been being is are was were am do does did "
    "can could will would shall should may might must have has had "
    "how what where when why which who whom whose please hi hello hey thanks thank for of on in at with and or but so "
    "if then than this that these those there here any some yes possible way using use get got much many just "
    "kindly actually really also still".split())
NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80",
                     "ninety": "90", "hundred": "100", "thousand": "1000", "million": "1000000"})
_TOKEN = re.compile(r"[A-Za-z]+(?:'[a-z]+)?|\d+(?:[.,]\d+)*")
_SENTENCE = re.compile(r"[.?!;,]+(?:\s+|$)")  # clause ends (a decimal point has no space after it)
DEFAULT_THRESHOLD = 0.9


def guard_signature(text: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(numbers, negated words, named entities, polarity words) of ``text``: two questions may share an answer only
    if these are equal. Numbers keep their order; each negation (``NEGATIONS``, ``n't``) is recorded as what it
    applies to: the content words of its clause (:func:`content_words`, clauses end at ``.?!;,``), in order, so
    "can I not return it?" and "can I return it? I don't need it." differ while "why is my app not syncing?" and
    "why isn't my app syncing?" do not; entities are the capitalized words after the
    first word (and any word with a capital past its first letter or a digit), lower-cased, possessives stripped,
    as a sorted tuple; polarity words (``POLARITY_WORDS``) keep their order."""
    tokens = _TOKEN.findall(text)
    numbers, negated, entities, polarity = [], [], set(), []
    for sentence in _SENTENCE.split(text):
        words = [t.lower() for t in _TOKEN.findall(sentence)]
        for w in words:
            if w.endswith("n't") or w in NEGATIONS:  # what it negates: the content words of its sentence
                negated.append(" ".join(sorted(set(content_words(sentence)))))
    for i, tok in enumerate(tokens):
        low = tok.lower()
        if low.endswith("n't") or low in NEGATIONS:
            continue
        if tok[0].isdigit():
            numbers.append(tok.replace(",", ""))
            continue
        if low in NUMBER_WORDS:
            numbers.append(NUMBER_WORDS[low])
            continue
        if low in POLARITY_WORDS:
            polarity.append(low)
            continue
        word = tok[:-2] if low.endswith("'s") else tok
        if (i > 0 and word[0].isupper() and word != "I") or any(c.isupper() for c in word[1:]):
            entities.add(word.lower())
    return tuple(numbers), tuple(negated), tuple(sorted(entities)), tuple(polarity)


def content_words(text: str) -> tuple[str, ...]:
    """The lower-cased words of ``text`` that carry content (letters only, 3 or more, no function words), in
    order."""
    return tuple(low for low in (t.lower() for t in _TOKEN.findall(text))
                 if low[0].isalpha() and len(low) >= 3 and "'" not in low and low not in _FUNCTION_WORDS
                 and low not in NEGATIONS)


def query_signature(text: str) -> tuple[tuple, tuple[str, ...]]:
    """What :func:`guards_match` compares: (:func:`guard_signature`, :func:`content_words`)."""
    return guard_signature(text), content_words(text)


def _adds_a_modifier(short: tuple[str, ...], long: tuple[str, ...]) -> bool:
    """Whether ``long`` has every content word of ``short`` plus one placed right before a shared word (a
    modifier: "reset my *email* password")."""
    kept = set(short)
    if not kept < set(long):
        return False
    return any(w not in kept and nxt in kept for w, nxt in zip(long, long[1:], strict=False))


def guards_match(a: tuple[tuple, tuple[str, ...]], b: tuple[tuple, tuple[str, ...]]) -> bool:
    """Whether two questions' :func:`query_signature` allow them to share an answer: equal guard signatures, and
    neither adds a modifier to the other's words (:func:`_adds_a_modifier`: "reset my email password" is not
    "reset my password", while "where is my order now" may be "where is my order")."""
    (ga, wa), (gb, wb) = a, b
    return ga == gb and not _adds_a_modifier(wa, wb) and not _adds_a_modifier(wb, wa)


class SemanticIndex:
    """Cached questions' vectors by context key; at most ``max_entries`` (the oldest go first). Thread-safe."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[bytes, np.ndarray, Any]] = OrderedDict()  # entry key -> ...
        self._by_context: dict[bytes, set[bytes]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry_key: bytes, context_key: bytes, vector: np.ndarray, signature: Any) -> None:
        with self._lock:
            if entry_key in self._entries:
                self._drop(entry_key)
            while len(self._entries) >= self.max_entries:
                self._drop(next(iter(self._entries)))
            self._entries[entry_key] = (context_key, vector, signature)
            self._by_context.setdefault(context_key, set()).add(entry_key)

    def _drop(self, entry_key: bytes) -> None:
        context_key, _, _ = self._entries.pop(entry_key)
        keys = self._by_context[context_key]
        keys.discard(entry_key)
        if not keys:
            del self._by_context[context_key]

    def match(self, context_key: bytes, vector: np.ndarray, signature: Any, threshold: float
              ) -> tuple[bytes, float] | None:
        """(entry key, similarity) of the best cached question of that context with the same guard signature,
        if its similarity reaches ``threshold``; else None."""
        with self._lock:
            keys = [k for k in self._by_context.get(context_key, ()) if guards_match(self._entries[k][2], signature)]
            if not keys:
                return None
            sims = np.stack([self._entries[k][1] for k in keys]) @ vector
        best = int(np.argmax(sims))
        return (keys[best], float(sims[best])) if sims[best] >= threshold else None

    def discard(self, entry_key: bytes) -> None:
        with self._lock:
            if entry_key in self._entries:
                self._drop(entry_key)
