"""Cheap detectors of code and math in a prompt, for :class:`leanserve.routing.rules.RulesPolicy`.

Each returns a short reason (what it saw) or None. They are regular expressions over the text, microseconds per
prompt, meant to catch the common cases, not to parse:

- code: a fenced block (```), a line that starts a definition or an import in a common language (``def f(``,
  ``class A:``, ``import x``, ``#include``, ``function f(``, ``public static``...), or at least two programming
  keywords with a density of code punctuation (``{}[]();=<>``) of at least 4 % of the non-space characters;
- math: LaTeX (``$...$``, ``\\(``, ``\\frac``, ``\\sum``...), an arithmetic expression with two operators or with an
  operand of two digits or more (``12 * 4``, ``3 + 4 - 1``; ``2 + 3`` alone is not), or a math verb (compute,
  calculate, solve, simplify, integrate, derivative, equation) next to a digit anywhere in the text.
"""

from __future__ import annotations

import re

_FENCE = re.compile(r"```|~~~")
_CODE_LINE = re.compile(
    r"^\s*(def\s+\w+\s*\(|class\s+\w+\s*[(:{]|import\s+\w+|from\s+\w+(\.\w+)*\s+import\s|#include\s*[<\"]|"
    r"function\s+\w+\s*\(|(public|private|static)\s+\w+|fn\s+\w+\s*\(|func\s+\w+\s*\(|"
    r"(const|let|var)\s+\w+\s*=|SELECT\s.+\sFROM\s)", re.MULTILINE)
_KEYWORDS = re.compile(r"\b(def|return|lambda|print|elif|while|range|import|function|const|var|void|null|None|"
                       r"printf|console|std|self|len|str|elif|endl|malloc|struct)\b")
_CODE_PUNCT = set("{}[]();=<>")
_LATEX = re.compile(r"\$[^$\n]+\$|\\\(|\\\[|\\(frac|sum|int|sqrt|cdot|times|alpha|beta|pi|lim|infty)\b")
_NUM = r"\d+(?:\.\d+)?"
_OP = r"\s*[-+*/^×÷%]\s*"
_EXPR2 = re.compile(rf"\(?{_NUM}\)?{_OP}\(?{_NUM}\)?{_OP}\(?{_NUM}")  # two operators
_EXPR_BIG = re.compile(rf"\d{{2,}}(?:\.\d+)?{_OP}\(?{_NUM}|{_NUM}{_OP}\(?\d{{2,}}")  # an operand of >= 2 digits
_MATH_VERB = re.compile(r"\b(compute|calculate|solve|simplify|integrate|derivative|equation|evaluate)\b", re.I)


def detect_code(text: str) -> str | None:
    """Why ``text`` looks like it holds code ("fenced code", "code line", "code keywords"), or None."""
    if _FENCE.search(text):
        return "fenced code"
    if _CODE_LINE.search(text):
        return "code line"
    keywords = len(set(_KEYWORDS.findall(text)))
    chars = [c for c in text if not c.isspace()]
    if keywords >= 2 and chars and sum(c in _CODE_PUNCT for c in chars) / len(chars) >= 0.04:
        return "code keywords"
    return None


def detect_math(text: str) -> str | None:
    """Why ``text`` looks like math ("latex", "arithmetic expression", "math verb with numbers"), or None."""
    if _LATEX.search(text):
        return "latex"
    if _EXPR2.search(text) or _EXPR_BIG.search(text):
        return "arithmetic expression"
    if _MATH_VERB.search(text) and re.search(r"\d", text):
        return "math verb with numbers"
    return None
