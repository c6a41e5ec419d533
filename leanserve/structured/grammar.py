"""Grammar-constrained decoding on xgrammar (Dong et al., "XGrammar", MLSys 2025; https://xgrammar.mlc.ai).

:class:`GrammarCompiler` builds xgrammar's tokenizer info from leanserve's own tokenizer (every token's bytes
from the GGUF vocabulary, special tokens never allowed as text, the model's stop ids as the grammar's end) and
compiles each distinct constraint once (an LRU cache keyed by :attr:`StructuredOutputsParams.key`).
:class:`GrammarState` is one request's matcher: it fills the request's rows of a step's token bitmask (one row per
position that samples, the rows after draft tokens from the state those drafts lead to, then rolled back), and
advances by the tokens the step accepted. :func:`apply_token_bitmask` sets the forbidden logits to -inf.

Why xgrammar and not llguidance: ``benchmarks/grammar_engines.py`` (README, "Structured outputs").
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from leanserve.errors import InvalidGrammarError
from leanserve.sampling_params import StructuredOutputsParams
from leanserve.tokenizer import Tokenizer

import torch

_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:123: " before messages


def _xgr():
    import xgrammar  # imported on first use: it takes ~2 s, and an engine may never see a grammar

    return xgrammar


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer; thread-safe (admission calls it from the HTTP
    thread).

    Args:
        tokenizer: the model's tokenizer (its vocabulary and stop ids).
        vocab_size: the model's logits width (may exceed the tokenizer's: the extra ids are never allowed).
        cache_size: compiled grammars kept (least recently used ones go first).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and metrics
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None

    def _engine(self):
        if self._compiler is None:
            xgr = _xgr()
            tok = self.tokenizer
            tokens = [b"" if tok.is_special(i) else tok.token_bytes(i) for i in range(tok.vocab_size)]
            info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=max(self.vocab_size, tok.vocab_size),
                                     stop_token_ids=sorted(tok.stop_token_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, so: StructuredOutputsParams, param: str = "structured_outputs") -> Any:
        """The compiled grammar of ``so`` (an ``xgrammar.CompiledGrammar``), from the cache when seen before.

        Raises:
            InvalidGrammarError: the schema / regex / grammar is invalid or unsupported; ``param`` names the field.
        """
        key = so.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiled = self._compile(key, param)
            self.num_compiled += 1
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, key: tuple[str, str], param: str) -> Any:
        kind, text = key
        c = self._engine()
        try:
            if kind == "json":
                return c.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                alts = " | ".join(json.dumps(x, ensure_ascii=False) for x in json.loads(text))
                return c.compile_grammar(f"root ::= {alts}")
            if kind == "structural_tag":
                return c.compile_structural_tag(json.dumps(_compact_json(json.loads(text))))
            return c.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors, with the C++ location first
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                    "choice": "choice", "grammar": "EBNF grammar", "structural_tag": "tool or structural tag "
                    "schema"}[kind]
            message = _CPP_PREFIX.sub("", str(exc).strip()).splitlines()[0] if str(exc).strip() else repr(exc)
            raise InvalidGrammarError(f"invalid or unsupported {what}: {message}", param) from None


def _compact_json(node: Any) -> Any:
    """A structural tag whose JSON-schema contents are grammars of compact JSON (``", "`` and ``": "`` as the only
    whitespace, as every JSON output here), so arguments come out as ``{"city": "Paris"}`` and ``{}``."""
    if isinstance(node, list):
        return [_compact_json(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        ebnf = _xgr().Grammar.from_json_schema(json.dumps(node["json_schema"]), any_whitespace=False,
                                               strict_mode=True)
        return {"type": "grammar", "grammar": str(ebnf)}
    return {k: _compact_json(v) for k, v in node.items()}


class GrammarState:
    """The matcher of one sequence: which tokens its grammar allows next.

    Args:
        compiled: from :meth:`GrammarCompiler.compile`.
    """

    def __init__(self, compiled: Any) -> None:
        self.matcher = _xgr().GrammarMatcher(compiled)

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.matcher.is_terminated()

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int] = ()) -> int:
        """Fill ``bitmask[first_row]`` with the tokens allowed now, and ``bitmask[first_row + j]`` with those
        allowed after ``drafts[:j]``, while the grammar accepts the drafts; the matcher is rolled back after.

        Args:
            bitmask: ``[rows, bitmask_words(vocab)]`` int32 (bit ``t % 32`` of word ``t // 32`` is token ``t``).

        Returns:
            the rows filled: 1 + the number of leading drafts the grammar accepts. A draft it forbids is rejected
            by the verification, since the row before it excludes it; the rows after it are never kept.
        """
        m = self.matcher
        m.fill_next_token_bitmask(bitmask, first_row)
        accepted = 0
        for t in drafts:
            if m.is_terminated() or not m.accept_token(int(t)):
                break
            accepted += 1
            m.fill_next_token_bitmask(bitmask, first_row + accepted)
        if accepted:
            m.rollback(accepted)
        return 1 + accepted

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance by the tokens a step kept. False if the grammar refused one (the mask was not applied)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return True  # a stop token ended it; the scheduler ends the request there
            if not self.matcher.accept_token(int(t)):
                return False
        return True


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: ``logits[i, t] = -inf`` for every row ``i`` in ``rows`` whose bit ``t`` in ``bitmask[i]`` is 0,
    and for every id past the bitmask's width.

    Args:
        logits: ``[n, vocab]`` float32 CPU. bitmask: ``[n, words]`` int32 CPU, rows aligned with ``logits``.
    """
    if not rows:
        return
    vocab = logits.shape[1]
    covered = bitmask.shape[1] * 32
    if covered < vocab:
        logits[rows, covered:] = float("-inf")
    _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab, covered), indices=rows)
