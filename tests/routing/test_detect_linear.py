"""The detectors and the logistic features run in linear, bounded time (issue 18, item 1): long digit, newline
or space runs used to make ``_EXPR2``, ``_EXPR_BIG`` and ``_CODE_LINE`` quadratic (12 s for 12 KB)."""

from __future__ import annotations

import time

from leanserve.routing import detect
from leanserve.routing.learned import text_features

import pytest

RUNS = {"digits": "1", "newlines": "\n", "digit-space": "1 ", "digit-plus": "1+", "space-newline": " \n"}


def _seconds(f, text: str, repeats: int = 1) -> float:
    best = float("inf")
    for _ in range(repeats):  # the best of a few: the machine is shared
        t = time.perf_counter()
        f(text)
        best = min(best, time.perf_counter() - t)
    return best


@pytest.mark.parametrize("unit", list(RUNS.values()), ids=list(RUNS))
def test_a_megabyte_run_is_judged_fast(unit):
    text = "hi " + unit * (1_000_000 // len(unit))
    for f in (detect.detect_code, detect.detect_math, text_features):
        assert _seconds(f, text) < 5.0, f.__name__  # quadratic: minutes; generous for a loaded CI machine


@pytest.mark.parametrize("unit", list(RUNS.values()), ids=list(RUNS))
def test_the_patterns_are_linear_without_the_window(unit):
    for f in (detect._detect_code, detect._detect_math):
        small = _seconds(f, unit * (100_000 // len(unit)), 3)
        big = _seconds(f, unit * (1_000_000 // len(unit)), 2)
        # linear: ~10x for 10x the text; quadratic: ~100x (and minutes). Generous for a loaded machine
        assert big < 10.0 and big / max(small, 5e-3) < 40, (f.__name__, small, big)


def test_the_window_keeps_both_ends():
    filler = "word " * 10_000
    assert detect.detect_math(filler + "what is 12 * 4") == "arithmetic expression"
    assert detect.detect_code("def f(x):\n" + filler) == "code line"
    assert detect.detect_math(filler[:30_000] + " 12 * 4 " + filler[:30_000]) is None  # the middle is not read
    assert detect.window("short") == "short"
    assert len(detect.window(filler)) == 2 * detect.WINDOW_CHARS + 1


def test_the_detectors_still_see_what_they_saw():
    assert detect.detect_math("12 * 4") == "arithmetic expression"
    assert detect.detect_math("3 + 4 - 1") == "arithmetic expression"
    assert detect.detect_math("2 + 3") is None
    assert detect.detect_math("1.5 + 22.25 = ?") == "arithmetic expression"
    assert detect.detect_code("x = 1\n    def f(a):\n") == "code line"
    assert detect.detect_code("SELECT a FROM t") == "code line"
