"""Scoring one model answer against a test case's ``expected`` value: exact, contains, regex, json_valid, rougeL.

(``choice`` is scored by log-likelihood in :mod:`leanserve.tools.eval`, not from generated text.)
"""

from __future__ import annotations

import json
import re

from leanserve.errors import InvalidParameterError

TEXT_METRICS = ("exact", "contains", "regex", "json_valid", "rougeL")
ALL_METRICS = TEXT_METRICS + ("choice",)
ROUGE_L_PASS = 0.5  # an answer "passes" rougeL at this F-measure; the mean F-measure is reported too


def _norm(s: str) -> str:
    return " ".join(s.strip().split()).casefold()


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F-measure (Lin, 2004; beta = 1) over case-folded whitespace tokens: LCS-based, in [0, 1]."""
    a, b = _norm(candidate).split(), _norm(reference).split()
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:  # LCS by dynamic programming, one row at a time
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def _json_payload(text: str) -> str:
    """The text, or the body of a ```json fenced block in it."""
    m = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    return m.group(1) if m else text


def score(metric: str, output: str, expected: object) -> float:
    """Score in [0, 1] of ``output`` for ``metric``:

    * exact: 1 when equal after trimming, collapsing whitespace and case-folding.
    * contains: 1 when the normalized ``expected`` (a string, or a list of strings: all of them) occurs in it.
    * regex: 1 when ``re.search(expected, output)`` matches (multiline, dotall).
    * json_valid: 1 when the output (or its fenced ```json block) parses as JSON; with a non-null ``expected``
      dict, every key of it must also be present with that value.
    * rougeL: the ROUGE-L F-measure against ``expected``.

    Raises:
        InvalidParameterError: unknown metric, or a bad regex.
    """
    if metric == "exact":
        return float(_norm(output) == _norm(str(expected)))
    if metric == "contains":
        wanted = expected if isinstance(expected, list) else [expected]
        return float(all(_norm(str(w)) in _norm(output) for w in wanted))
    if metric == "regex":
        try:
            return float(re.search(str(expected), output, re.M | re.S) is not None)
        except re.error as exc:
            raise InvalidParameterError("expected", f"bad regex {expected!r}: {exc}") from exc
    if metric == "json_valid":
        try:
            value = json.loads(_json_payload(output))
        except json.JSONDecodeError:
            return 0.0
        if isinstance(expected, dict):
            return float(isinstance(value, dict) and all(value.get(k) == v for k, v in expected.items()))
        return 1.0
    if metric == "rougeL":
        return rouge_l(output, str(expected))
    raise InvalidParameterError("metric", f"unknown metric {metric!r}; supported: {', '.join(ALL_METRICS)}")
