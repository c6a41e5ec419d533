"""Real text available offline for the benchmark workloads: the Python standard library's own source files.

Code comes from the ``*.py`` files of the running interpreter's standard library (``sysconfig.get_paths()
["stdlib"]``) and English prose from their module, class and function docstrings. Both are distributed with
Python under the PSF License (Python Software Foundation License Version 2). The text depends on the Python
version, so workloads are reproducible for a given interpreter version and seed.
"""

from __future__ import annotations

import ast
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from leanserve.tokenizer import Tokenizer

SOURCE_NOTE = "Python standard library sources and docstrings (PSF License)"


def stdlib_root() -> Path:
    """Folder of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(min_chars: int = 0) -> list[Path]:
    """The top-level ``*.py`` files of the standard library with at least ``min_chars`` characters, sorted by name."""
    return [p for p in sorted(stdlib_root().glob("*.py")) if p.stat().st_size >= min_chars]


def corpus_text(max_chars: int = 2_000_000) -> str:
    """The standard library's sources concatenated in name order, about ``max_chars`` characters (at least one file
    past the limit is not cut)."""
    parts, total = [], 0
    for name in stdlib_files():
        text = name.read_text(encoding="utf-8", errors="ignore")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(parts)


@dataclass(frozen=True)
class Passage:
    """One docstring: ``source`` is ``module.Qualified.name``, ``text`` its cleaned text."""

    source: str
    text: str


def docstring_passages(min_chars: int = 300, max_total_chars: int = 400_000) -> list[Passage]:
    """Docstrings of at least ``min_chars`` characters from the standard library's modules, classes and functions,
    in file and source order, until ``max_total_chars`` characters are collected. Files that do not parse are
    skipped."""
    out: list[Passage] = []
    total = 0
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        module = path.stem
        for qualname, node in _documented(tree, module):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars and doc.isascii():
                out.append(Passage(qualname, doc))
                total += len(doc)
                if total >= max_total_chars:
                    return out
    return out


def _documented(node: ast.AST, prefix: str):
    """(qualified name, node) of ``node`` and of the classes and functions nested in it, in source order."""
    yield prefix, node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _documented(child, f"{prefix}.{child.name}")


@dataclass
class Corpus:
    """The offline text the workloads draw from, with its token ids under one tokenizer.

    Attributes:
        tokenizer: the served model's tokenizer (lengths are counted in its tokens).
        code_files: (file name, source text) of the larger standard-library files.
        passages: docstring passages (English prose).
    """

    tokenizer: Tokenizer
    code_files: list[tuple[str, str]]
    passages: list[Passage]

    @classmethod
    def load(cls, tokenizer: Tokenizer, max_code_files: int = 60) -> Corpus:
        """Read the standard library: up to ``max_code_files`` files of >= 8,000 characters (spread evenly over
        the sorted list) and the docstring passages (a few seconds)."""
        files = stdlib_files(min_chars=8_000)
        step = max(1, len(files) // max_code_files)
        code = [(p.name, p.read_text(encoding="utf-8", errors="ignore")) for p in files[::step][:max_code_files]]
        return cls(tokenizer, code, docstring_passages())

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` (no BOS/special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def head(self, text: str, num_tokens: int) -> str:
        """The longest prefix of ``text`` made of its first ``num_tokens`` tokens, as text."""
        # No token is longer than 16 characters in practice: encode only the part that can matter.
        ids = self.tokenizer.encode(text[: 16 * max(0, num_tokens) + 64], add_special_tokens=False)
        return self.tokenizer.decode(ids[:max(0, num_tokens)])
