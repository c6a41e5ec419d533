"""The semantic answer cache's matching: an embedding of the new question against those of cached questions
asked in the same context, behind a lexical guard.

- **Embedding**: WordLlama (:class:`leanserve.embeddings.WordLlamaEmbedder`, re-exported here: the weights ship
  in the ``wordllama`` package, nothing is fetched at run time), cosine similarity of the L2-normalized vectors.
- **Guard** (:func:`guard_signature`): a bag-of-words embedding barely moves when one word changes, yet "after
  30 days" / "after 60 days", "can I" / "can't I" and "to Canada" / "to Mexico" need other answers. Two
  questions may match only if they have the same numbers (digits, and number words as digits), the same
  negations (what each applies to), the same capitalized words after the first (named entities), the same
  polarity words, and the same :func:`strict_signature`: question words, pronouns' persons in order, tense,
  the word after each number, each preposition's object, and the content words (normalized, a small synonym and
  filler list applied) as equal sets in the same order. Strict by design: a lost hit costs one recomputation, a
  wrong answer is served to a user.
- **Match** (:class:`SemanticIndex`): the most similar cached question whose guard signature is equal and whose
  context key (everything else: system prompt, earlier turns, parameters) is the same, if its similarity is at
  least the threshold.
"""

from __future__ import annotations

import re
import sys
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
    "once twice again immediately instantly always only every each all both "
    # conjunctions and signs: "cash and card" is not "cash or card", "minus 5" not "5"
    "and or nor but versus vs plus minus negative positive".split())
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
# words; numbers with their sign ("-10" is not "10"; a hyphen inside a word, "COVID-19", is not a sign)
_TOKEN = re.compile(r"[A-Za-z]+(?:'[a-z]+)?|(?:(?<![A-Za-z0-9])[-\u2212])?\d+(?:[.,]\d+)*")
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
        if _is_number(tok):
            numbers.append(_number(tok))
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


QUESTION_WORDS = {"how": "how", "why": "why", "when": "when", "where": "where", "what": "what", "which": "what",
                  "who": "who", "whom": "who", "whose": "whose", "whether": "whether"}  # "which" is "what"
# pronouns and possessives by person (the order in which the persons come is kept: "can you reset my password"
# is not "can I reset your password"); the expletive "it" ("is it possible") is left out
PERSONS = {w: k for k, ws in {"1s": "i me my mine myself", "2": "you your yours yourself yourselves",
                                "1p": "we us our ours ourselves", "3m": "he him his himself",
                                "3f": "she her hers herself", "3n": "its itself",
                                "3p": "they them their theirs themselves"}.items() for w in ws.split()}
TENSES = {"was": "past", "were": "past", "did": "past", "had": "past", "will": "future", "shall": "future",
          "won't": "future"}  # auxiliaries: "was X free?" is not "is X free?"
PREPOSITIONS = frozenset("to from for with without by at in on of into onto about via between through toward "
                         "towards near across per against under over after before within since until during "
                         "than".split())
PREPOSITION_SYNONYMS = {"using": "with", "via": "by", "towards": "toward"}
_DETERMINERS = frozenset("a an the this that these those some any each every another other my your our their his "
                         "her its".split())
# "to" after these marks an infinitive ("is it possible to return"), not a direction
_INFINITIVE_BEFORE = frozenset("possible way able want wants need needs like wish try going have has how".split())
# content words that do not change a question's answer (dropped before the sets are compared) and synonyms (mapped
# to one word first); kept small and explicit: a lost hit costs one recomputation, a wrong answer is wrong
FILLERS = frozenset("possible way please kindly actually really also still just exactly currently now".split())
SYNONYMS = {"deliver": "ship", "delivery": "shipping", "delivered": "shipped"}


def stem(word: str) -> str:
    """A light English normalization (plural, -ed, -ing, a final e, a doubled final consonant): "addresses" ->
    "address", "declined" / "declining" -> "declin", "shipping" -> "ship"; only ever compared with itself."""
    w = word
    if len(w) > 4 and w.endswith("ies"):
        w = w[:-3] + "y"
    elif w.endswith("sses"):
        w = w[:-2]
    elif len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    if len(w) > 5 and w.endswith("ing"):
        w = w[:-3]
    elif len(w) > 4 and w.endswith("ed"):
        w = w[:-2]
    if len(w) > 4 and w.endswith("e"):
        w = w[:-1]
    if len(w) >= 4 and w[-1] == w[-2] and w[-1] not in "lsz":
        w = w[:-1]
    return w


_FILLER_STEMS = frozenset(stem(f) for f in FILLERS)


def _is_number(tok: str) -> bool:
    return tok[0].isdigit() or (len(tok) > 1 and tok[0] in "-\u2212")


def _number(low: str) -> str | None:
    """A number token or word as digits (a minus sign as "-", thousands separators dropped); None otherwise."""
    if _is_number(low):
        return "-" + low[1:].replace(",", "") if low[0] in "-\u2212" else low.replace(",", "")
    return NUMBER_WORDS.get(low)


def guardable(text: str) -> bool:
    """Whether the lexical guard can read ``text``: every letter in it is ASCII. The guard's word lists are
    English and it splits words on ASCII letters, so in other scripts (Chinese, Japanese, Cyrillic, ...) it would
    see no negation, order or entity at all: such questions get the exact cache only, never a semantic hit."""
    return all(c.isascii() for c in text if c.isalpha())


def strict_signature(text: str) -> tuple:
    """What else two questions must share to share an answer (the strict guard): their question words
    (``QUESTION_WORDS``), the persons of their pronouns and possessives in order (``PERSONS``, repeats of one
    person merged), the tense of their auxiliaries (``TENSES``), the word after each number, each preposition's
    object (the next word past determiners; ``PREPOSITION_SYNONYMS`` applied) as a sorted tuple, and their content
    words (:func:`content_words`, :func:`stem`-med, ``SYNONYMS`` applied, ``FILLERS`` dropped) in order of first
    appearance: equal sets in the same order, so "5 miles to kilometers" is not "5 kilometers to miles" and a
    word added on either side ("by express", "tomorrow") keeps them apart."""
    tokens = [t.lower() for t in _TOKEN.findall(text)]
    bare = [t[:-2] if t.endswith("'s") else t for t in tokens]  # "what's", "where's", "my company's"
    questions = tuple(sorted({QUESTION_WORDS[t] for t in bare if t in QUESTION_WORDS}))
    persons: list[str] = []
    for t in bare:
        p = PERSONS.get(t)
        if p is not None and (not persons or persons[-1] != p):
            persons.append(p)
    tenses = tuple(sorted({TENSES[t] for t in tokens if t in TENSES}))
    after_numbers, objects = [], set()
    for i, t in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if _number(t) is not None:
            after_numbers.append(stem(nxt) if nxt and _number(nxt) is None else nxt)
        prep = PREPOSITION_SYNONYMS.get(t, t)
        if prep in PREPOSITIONS and not (prep == "to" and i and tokens[i - 1] in _INFINITIVE_BEFORE):
            j = i + 1
            while j < len(tokens) and tokens[j] in _DETERMINERS:
                j += 1
            obj = tokens[j] if j < len(tokens) else ""
            objects.add((prep, _number(obj) or stem(SYNONYMS.get(obj, obj)) if obj else ""))
    content: list[str] = []
    for w in content_words(text):
        w = stem(SYNONYMS.get(w, w))
        if w not in _FILLER_STEMS and w not in PREPOSITIONS and w not in content:  # prepositions: in objects
            content.append(w)
    return (questions, tuple(persons), tenses, tuple(after_numbers), tuple(sorted(objects)), tuple(content))


def query_signature(text: str) -> tuple[tuple, tuple]:
    """What :func:`guards_match` compares: (:func:`guard_signature`, :func:`strict_signature`); hashable."""
    return guard_signature(text), strict_signature(text)


def guards_match(a: tuple[tuple, tuple], b: tuple[tuple, tuple]) -> bool:
    """Whether two questions' :func:`query_signature` allow them to share an answer: both signatures equal (the
    strict guard: a lost hit costs one recomputation, a wrong answer is served to a user)."""
    return a == b


SEMANTIC_ENTRY_OVERHEAD = 768  # bytes charged per index entry besides its row and signature: dict / list slots,
# key objects, the bucket's share (tested with tracemalloc)


def _sizeof(obj: Any) -> int:
    """Bytes of ``obj`` and the tuples / strings / bytes inside it (sys.getsizeof, recursively)."""
    n = sys.getsizeof(obj)
    if isinstance(obj, tuple):
        n += sum(_sizeof(x) for x in obj)
    return n


class _Bucket:
    """The vectors of one (context, signature): rows of one float32 matrix, grown by doubling."""

    __slots__ = ("keys", "matrix")

    def __init__(self, dim: int) -> None:
        self.keys: list[bytes] = []
        self.matrix = np.empty((1, dim), np.float32)


class SemanticIndex:
    """Cached questions' vectors, by (context key, :func:`query_signature`): only questions whose guards match can
    share an answer (:func:`guards_match` is equality), so a lookup is one matrix-vector product over the cached
    questions of that context with the same signature (numpy), whatever the index holds elsewhere.

    Bounded by the answer cache it serves: each entry's bytes (:meth:`entry_nbytes`: its row, counted twice for
    the matrix's doubling slack, its signature and :data:`SEMANTIC_ENTRY_OVERHEAD`) are charged to its answer's
    entry and the entry is :meth:`discard`-ed when that answer leaves the cache (LRU, TTL); ``max_entries`` is a
    last guard (oldest first). Thread-safe.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._where: OrderedDict[bytes, tuple[bytes, Any]] = OrderedDict()  # entry key -> bucket key, oldest first
        self._buckets: dict[tuple[bytes, Any], _Bucket] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._where)

    @staticmethod
    def entry_nbytes(vector: np.ndarray, signature: Any) -> int:
        """The bytes one entry holds (an upper bound: a signature shared by a bucket's entries is counted each
        time)."""
        return 2 * int(np.asarray(vector).nbytes) + _sizeof(signature) + SEMANTIC_ENTRY_OVERHEAD

    def add(self, entry_key: bytes, context_key: bytes, vector: np.ndarray, signature: Any) -> None:
        vector = np.asarray(vector, np.float32)
        with self._lock:
            if entry_key in self._where:
                self._drop(entry_key)
            while len(self._where) >= self.max_entries:
                self._drop(next(iter(self._where)))
            bkey = (context_key, signature)
            bucket = self._buckets.get(bkey)
            if bucket is None:
                bucket = self._buckets[bkey] = _Bucket(vector.shape[0])
            n = len(bucket.keys)
            if n == bucket.matrix.shape[0]:
                grown = np.empty((2 * n, bucket.matrix.shape[1]), np.float32)
                grown[:n] = bucket.matrix
                bucket.matrix = grown
            bucket.matrix[n] = vector
            bucket.keys.append(entry_key)
            self._where[entry_key] = bkey

    def _drop(self, entry_key: bytes) -> None:
        bkey = self._where.pop(entry_key)
        bucket = self._buckets[bkey]
        row, last = bucket.keys.index(entry_key), len(bucket.keys) - 1
        if row != last:  # the last row takes its place
            bucket.matrix[row] = bucket.matrix[last]
            bucket.keys[row] = bucket.keys[last]
        bucket.keys.pop()
        if not bucket.keys:
            del self._buckets[bkey]
        elif 4 * len(bucket.keys) <= bucket.matrix.shape[0]:
            bucket.matrix = bucket.matrix[:2 * len(bucket.keys)].copy()

    def match(self, context_key: bytes, vector: np.ndarray, signature: Any, threshold: float
              ) -> tuple[bytes, float] | None:
        """(entry key, similarity) of the most similar cached question of that context with the same guard
        signature, if its similarity reaches ``threshold``; else None."""
        with self._lock:
            bucket = self._buckets.get((context_key, signature))
            if bucket is None:
                return None
            n = len(bucket.keys)
            sims = bucket.matrix[:n] @ np.asarray(vector, np.float32)
            best = int(np.argmax(sims))
            key, sim = bucket.keys[best], float(sims[best])
        return (key, sim) if sim >= threshold else None

    def discard(self, entry_key: bytes) -> None:
        with self._lock:
            if entry_key in self._where:
                self._drop(entry_key)
