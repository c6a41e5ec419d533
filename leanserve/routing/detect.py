"""Cheap detectors of code and math in a prompt, for :class:`leanserve.routing.rules.RulesPolicy`.

Each returns a short reason (what it saw) or None. They are regular expressions over the text, microseconds per
prompt, meant to catch the common cases, not to parse:

- code: a fenced block (```), a line that starts a definition or an import in a common language (``def f(``,
  ``class A:``, ``import x``, ``#include``, ``function f(``, ``public static``...), or at least two programming
  keywords with a density of code punctuation (``{}[]();=<>``) of at least 4 % of the non-space characters;
- math: LaTeX (``$...$``, ``\\(``, ``\\frac``, ``\\sum``...), an arithmetic expression with two operators or with an
  operand of two digits or more (``12 * 4``, ``3 + 4 - 1``; ``2 + 3`` alone is not), or a math verb (compute,
  calculate, solve, simplify, integrate, derivative, equation) next to a digit anywhere in the text.

Bounded work: a text longer than ``2 x WINDOW_CHARS`` is judged by its first and last :data:`WINDOW_CHARS`
characters only (joined by a newline), and every pattern runs in time linear in what it reads (no overlapping
quantifiers: a number may start only where no digit precedes it, a code line's indent is spaces and tabs), so a
megabyte prompt costs what a 16 KB one does.
"""

from __future__ import annotations

import re

WINDOW_CHARS = 8192  # characters judged at each end of a long text

_FENCE = re.compile(r"```|~~~")
_CODE_LINE = re.compile(
    r"^[ \t]*(def\s+\w+\s*\(|class\s+\w+\s*[(:{]|import\s+\w+|from\s+\w+(\.\w+)*\s+import\s|#include\s*[<\"]|"
    r"function\s+\w+\s*\(|(public|private|static)\s+\w+|fn\s+\w+\s*\(|func\s+\w+\s*\(|"
    r"(const|let|var)\s+\w+\s*=|SELECT\s[^\n]*?\sFROM\s)", re.MULTILINE)
_KEYWORDS = re.compile(r"\b(def|return|lambda|print|elif|while|range|import|function|const|var|void|null|None|"
                       r"printf|console|std|self|len|str|elif|endl|malloc|struct)\b")
_CODE_PUNCT = set("{}[]();=<>")
_LATEX = re.compile(r"\$[^$\n]+\$|\\\(|\\\[|\\(frac|sum|int|sqrt|cdot|times|alpha|beta|pi|lim|infty)\b")
_NUM = r"(?<!\d)\d+(?:\.\d+)?"  # a number starts where no digit precedes it (linear scans)
_OP = r"\s*[-+*/^×÷%]\s*"
_EXPR2 = re.compile(rf"\(?{_NUM}\)?{_OP}\(?{_NUM}\)?{_OP}\(?{_NUM}")  # two operators
_EXPR_BIG = re.compile(rf"(?<!\d)\d{{2,}}(?:\.\d+)?{_OP}\(?{_NUM}|{_NUM}{_OP}\(?\d{{2,}}")  # an operand of >= 2 digits
_MATH_VERB = re.compile(r"\b(compute|calculate|solve|simplify|integrate|derivative|equation|evaluate)\b", re.I)


def window(text: str) -> str:
    """What the detectors judge of ``text``: all of it up to ``2 x WINDOW_CHARS`` characters, else its first and
    last :data:`WINDOW_CHARS` characters joined by a newline."""
    if len(text) <= 2 * WINDOW_CHARS:
        return text
    return text[:WINDOW_CHARS] + "\n" + text[-WINDOW_CHARS:]


def detect_code(text: str) -> str | None:
    """Why ``text`` (its :func:`window`) looks like it holds code ("fenced code", "code line", "code keywords"),
    or None."""
    return _detect_code(window(text))


def _detect_code(text: str) -> str | None:
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
    """Why ``text`` (its :func:`window`) looks like math ("latex", "arithmetic expression", "math verb with
    numbers"), or None."""
    return _detect_math(window(text))


def _detect_math(text: str) -> str | None:
    if _LATEX.search(text):
        return "latex"
    if _EXPR2.search(text) or _EXPR_BIG.search(text):
        return "arithmetic expression"
    if _MATH_VERB.search(text) and re.search(r"\d", text):
        return "math verb with numbers"
    return None
