"""The routing benchmark's labelled set: rebuilt from its generator it is the committed file, byte for byte;
every item's own answer passes its checker and wrong answers fail; the splits are the documented sizes."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from benchmarks.routing_data import SET_PATH, build, is_correct


def test_committed_set_is_the_generator_output():
    rebuilt = "".join(json.dumps(row) + "\n" for row in build())
    assert SET_PATH.read_text() == rebuilt
    items = build()
    assert len(items) == 360 and len({it["question"] for it in items}) == 360
    assert Counter(it["label"] for it in items) == {"easy": 150, "hard": 210}
    assert Counter(it["split"] for it in items) == {"examples": 108, "calibration": 108, "heldout": 144}
    for it in items:
        assert is_correct(it["answer"], it), it


@pytest.mark.parametrize(("answer", "item", "ok"), [
    (" 89\nQ: next", {"check": "number", "answer": "89"}, True),
    ("The answer is 89.", {"check": "number", "answer": "89"}, True),
    ("8 9", {"check": "number", "answer": "89"}, False),
    ("\n89", {"check": "number", "answer": "89"}, True),  # leading whitespace is stripped first
    ("No.", {"check": "yesno", "answer": "no"}, True),
    ("not sure", {"check": "yesno", "answer": "no"}, False),
    (' "Mirath."', {"check": "exact", "answer": "Mirath"}, True),
    ("Mirath Bay", {"check": "exact", "answer": "Mirath"}, False),
    ("apple", {"check": "exact", "answer": "APPLE"}, True),
    ("apple", {"check": "exact_case", "answer": "APPLE"}, False),  # "in capital letters"
    ("APPLE.", {"check": "exact_case", "answer": "APPLE"}, True),
])
def test_checkers(answer, item, ok):
    assert is_correct(answer, item) is ok
