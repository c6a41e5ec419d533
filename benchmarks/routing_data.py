"""Builds the routing benchmark's labelled set (``benchmarks/data/routing_set.jsonl``) and the learned router's
labelled examples (``benchmarks/data/routing_examples.jsonl``), offline and deterministically (seed 0).

Each item: ``{"id", "split", "label", "category", "question", "answer", "check"}``.

- ``label``: ``"easy"`` (a lookup in a one-sentence text, copying 1-3 words, simple formatting, yes/no about a
  given sentence, one-digit sums) or ``"hard"`` (multi-step arithmetic, word problems, what a short program
  prints, counting letters, ordering by age, a lookup among four people's facts, copying 5-8 words), by
  construction of the category.
- ``check``: how :func:`is_correct` grades an answer: ``"exact"`` (the first line, stripped of spaces, quotes and
  a final period, equal ignoring case), ``"exact_case"`` (the same, case included), ``"number"`` (the first number
  in the answer equals ``answer``) or ``"yesno"`` (the first word is yes / no).
- ``split``: ``"examples"`` (the learned policy's labelled examples), ``"calibration"`` (its threshold, the cascade's
  logprob threshold) or ``"heldout"`` (everything the benchmark table and the share test report), 30 / 30 / 40 %,
  stratified by category.

Usage: ``python -m benchmarks.routing_data`` (rewrites both files; the same bytes each time).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SET_PATH = DATA / "routing_set.jsonl"
EXAMPLES_PATH = DATA / "routing_examples.jsonl"

NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emil", "Farah", "Gita", "Hugo", "Ines", "Jonas", "Kemal", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara"]
PLACES = ["Mirath", "Velora", "Kestrel Bay", "Dunmore", "Ostrava Nova", "Pellin", "Quarry Hill", "Saltmarsh",
          "Tovik", "Umberfall", "Westlake", "Yarrow", "Zentha", "Brindle", "Carrow"]
THINGS = ["apple", "river", "lantern", "copper", "garden", "window", "pencil", "harbor", "violin", "meadow",
          "rocket", "candle", "forest", "marble", "planet", "ticket", "basket", "mirror", "saddle", "tunnel"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "brown", "gray"]
ANIMALS = ["cat", "dog", "horse", "rabbit", "fox", "owl", "goat", "duck", "bear", "wolf"]
JOBS = ["baker", "pilot", "doctor", "teacher", "farmer", "painter", "sailor", "nurse", "judge", "chef"]


def _lookup(rng: random.Random) -> tuple[str, str, str]:
    name, place, job = rng.choice(NAMES), rng.choice(PLACES), rng.choice(JOBS)
    kind = rng.randrange(3)
    text = f"{name} is a {job} who lives in {place}."
    if kind == 0:
        return f"Text: {text}\nWhere does {name} live?", place, "exact"
    if kind == 1:
        return f"Text: {text}\nWhat is {name}'s job?", job, "exact"
    return f"Text: {text}\nWho lives in {place}?", name, "exact"


def _copy(rng: random.Random) -> tuple[str, str, str]:
    words = " ".join(rng.sample(THINGS, rng.randint(1, 3)))
    return f"Repeat exactly: {words}", words, "exact"


def _format(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(THINGS)
    if rng.random() < 0.5:
        return f"Write the word {word} in capital letters.", word.upper(), "exact_case"
    return f"What is the first letter of the word {word}?", word[0], "exact"


def _yesno(rng: random.Random) -> tuple[str, str, str]:
    animal, color = rng.choice(ANIMALS), rng.choice(COLORS)
    other = rng.choice([c for c in COLORS if c != color])
    asked = color if rng.random() < 0.5 else other
    return (f"Sentence: The {animal} is {color}.\nIs the {animal} {asked}? Answer yes or no.",
            "yes" if asked == color else "no", "yesno")


def _small_sum(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(1, 5), rng.randint(1, 4)
    return f"What is {a} + {b}?", str(a + b), "number"


def _multistep(rng: random.Random) -> tuple[str, str, str]:
    a, b, c, d = rng.randint(12, 49), rng.randint(3, 9), rng.randint(5, 60), rng.randint(11, 99)
    return f"Compute ({a} * {b}) - {c} + {d}.", str(a * b - c + d), "number"


def _word_problem(rng: random.Random) -> tuple[str, str, str]:
    name = rng.choice(NAMES)
    thing = rng.choice(THINGS)
    start, given, times = rng.randint(20, 60), rng.randint(3, 15), rng.randint(2, 4)
    bought = rng.randint(2, 9)
    return (f"{name} has {start} {thing}s, gives away {given}, then buys {times} boxes of {bought} {thing}s each. "
            f"How many {thing}s does {name} have now?", str(start - given + times * bought), "number")


def _code(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        xs = rng.sample(range(1, 30), 5)
        k, m = rng.randrange(5), rng.randint(2, 7)
        src = f"xs = {xs}\nprint(sorted(xs)[{k}] * {m})"
        value = sorted(xs)[k] * m
    elif kind == 1:
        n, s = rng.randint(3, 7), rng.randint(1, 5)
        src = f"total = {s}\nfor i in range({n}):\n    total += i * 2\nprint(total)"
        value = s + sum(i * 2 for i in range(n))
    else:
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        src = f"def f(a, b):\n    return a % b + a // b\n\nprint(f({a}, {b}))"
        value = a % b + a // b
    return f"What does this Python code print?\n```python\n{src}\n```", str(value), "number"


def _ordering(rng: random.Random) -> tuple[str, str, str]:
    names = rng.sample(NAMES, 4)
    ages = rng.sample(range(20, 70), 4)
    facts = " ".join(f"{n} is {a} years old." for n, a in zip(names, ages, strict=True))
    order = sorted(zip(ages, names, strict=True))
    which = rng.choice(["youngest", "second oldest"])
    answer = order[0][1] if which == "youngest" else order[-2][1]
    return f"{facts} Who is the {which}?", answer, "exact"


def _lookup_long(rng: random.Random) -> tuple[str, str, str]:
    people, places, jobs = rng.sample(NAMES, 4), rng.sample(PLACES, 4), rng.sample(JOBS, 4)
    text = " ".join(f"{n} is a {j} who lives in {p}." for n, j, p in zip(people, jobs, places, strict=True))
    k = rng.randrange(4)
    if rng.random() < 0.5:
        return f"Text: {text}\nWhere does {people[k]} live?", places[k], "exact"
    return f"Text: {text}\nWhat is {people[k]}'s job?", jobs[k], "exact"


def _copy_long(rng: random.Random) -> tuple[str, str, str]:
    words = " ".join(rng.sample(THINGS, rng.randint(5, 8)))
    return f"Repeat exactly: {words}", words, "exact"


def _count(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(THINGS) + rng.choice(THINGS)
    letter = rng.choice(sorted(set(word)))
    return f"How many times does the letter {letter} appear in the word {word}?", str(word.count(letter)), "number"


CATEGORIES = {  # name -> (label, generator, items)
    "lookup": ("easy", _lookup, 40), "copy": ("easy", _copy, 30), "format": ("easy", _format, 30),
    "yesno": ("easy", _yesno, 30), "small_sum": ("easy", _small_sum, 20),
    "multistep": ("hard", _multistep, 30), "word_problem": ("hard", _word_problem, 30), "code": ("hard", _code, 30),
    "ordering": ("hard", _ordering, 30), "count": ("hard", _count, 30),
    "lookup_long": ("hard", _lookup_long, 30), "copy_long": ("hard", _copy_long, 30),
}
SPLITS = (("examples", 0.3), ("calibration", 0.3), ("heldout", 0.4))


def build(seed: int = 0) -> list[dict]:
    """The whole set, in a fixed order (category by category, then shuffled with ``seed``)."""
    rng = random.Random(seed)
    items: list[dict] = []
    for category, (label, gen, n) in CATEGORIES.items():
        seen: set[str] = set()
        rows = []
        while len(rows) < n:
            question, answer, check = gen(rng)
            if question in seen:
                continue
            seen.add(question)
            rows.append({"label": label, "category": category, "question": question, "answer": answer,
                         "check": check})
        cut1, cut2 = round(n * SPLITS[0][1]), round(n * (SPLITS[0][1] + SPLITS[1][1]))
        for i, row in enumerate(rows):
            row["split"] = "examples" if i < cut1 else "calibration" if i < cut2 else "heldout"
        items.extend(rows)
    rng.shuffle(items)
    for i, row in enumerate(items):
        row["id"] = f"r{i:03d}"
    return [{k: row[k] for k in ("id", "split", "label", "category", "question", "answer", "check")}
            for row in items]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def is_correct(answer: str, item: dict) -> bool:
    """Whether ``answer`` (a model's text) passes ``item``'s checker: only its first line counts; ``"number"``: the
    first number in it equals ``item["answer"]``; ``"yesno"``: its first word is the answer; ``"exact"``: the line,
    stripped of spaces, quotes and periods at its ends, equals the answer ignoring case; ``"exact_case"``: the same
    without ignoring case."""
    lines = answer.strip().split("\n")
    text = lines[0].strip()
    if item["check"] == "number":
        m = _NUMBER.search(text)
        return m is not None and float(m.group()) == float(item["answer"])
    if item["check"] == "yesno":
        words = re.findall(r"[a-z]+", text.lower())
        return bool(words) and words[0] == item["answer"]
    text = text.strip(" \"'.")
    return text == item["answer"] if item["check"] == "exact_case" else text.lower() == item["answer"].lower()


def main() -> None:
    items = build()
    DATA.mkdir(parents=True, exist_ok=True)
    SET_PATH.write_text("".join(json.dumps(row) + "\n" for row in items))
    examples = [{"text": row["question"], "label": row["label"]} for row in items if row["split"] == "examples"]
    EXAMPLES_PATH.write_text("".join(json.dumps(row) + "\n" for row in examples))
    print(f"wrote {SET_PATH} ({len(items)} items) and {EXAMPLES_PATH} ({len(examples)} examples)")


if __name__ == "__main__":
    main()
