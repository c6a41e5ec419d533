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
                schema = supported_schema(json.loads(text))
                return c.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
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


# JSON Schema keywords the grammar engine would ignore (its output could then break the schema): refused.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "allOf", "if", "then", "else", "contains", "minContains", "maxContains", "patternProperties",
    "propertyNames", "dependentSchemas", "dependentRequired", "dependencies", "unevaluatedProperties",
    "unevaluatedItems", "uniqueItems", "multipleOf"})
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems")


def supported_schema(schema: Any, path: str = "#") -> Any:
    """``schema`` as the grammar engine gets it: ``format`` dropped (an annotation in JSON Schema, not enforced by
    validators by default; the engine would drop the string's length bounds with it).

    Raises:
        ValueError: a keyword of ``UNSUPPORTED_KEYWORDS`` anywhere in the schema (the message names it and its
            place), or an object that requires a property it forbids (``additionalProperties: false``)."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        return schema
    bad = sorted(UNSUPPORTED_KEYWORDS & schema.keys())
    if bad:
        raise ValueError(f"the keyword {bad[0]!r} is not supported (at {path})")
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if schema.get("additionalProperties") is False:
        missing = [r for r in schema.get("required", ()) if r not in props]
        if missing:
            raise ValueError(f"{path} requires {missing[0]!r} but allows no such property")
    out = {k: v for k, v in schema.items() if not (k == "format" and isinstance(v, str))}
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {n: supported_schema(v, f"{path}/{key}/{n}") for n, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [supported_schema(v, f"{path}/{key}/{i}") for i, v in enumerate(out[key])]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = supported_schema(out[key], f"{path}/{key}")
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [supported_schema(v, f"{path}/items/{i}") for i, v in enumerate(out[key])]
    return out


def _compact_json(node: Any) -> Any:
    """A structural tag whose JSON-schema contents are grammars of compact JSON (``", "`` and ``": "`` as the only
    whitespace, as every JSON output here), so arguments come out as ``{"city": "Paris"}`` and ``{}``."""
    if isinstance(node, list):
        return [_compact_json(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        ebnf = _xgr().Grammar.from_json_schema(json.dumps(supported_schema(node["json_schema"])), any_whitespace=False,
                                               strict_mode=True)
        return {"type": "grammar", "grammar": str(ebnf)}
    return {k: _compact_json(v) for k, v in node.items()}


class GrammarState:
    """The matcher of one sequence: which tokens its grammar allows next.

    Args:
        compiled: from :meth:`GrammarCompiler.compile`.
    """

    def __init__(self, compiled: Any, dead_end_token: int | None = None) -> None:
        self.matcher = _xgr().GrammarMatcher(compiled)
        self.dead_end_token = dead_end_token

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
        self._fill(bitmask, first_row)
        accepted = 0
        for t in drafts:
            if m.is_terminated() or not m.accept_token(int(t)):
                break
            accepted += 1
            if m.is_terminated():  # the draft was a stop token: the request ends there, no later row is kept
                break
            self._fill(bitmask, first_row + accepted)
        if accepted:
            m.rollback(accepted)
        return 1 + accepted

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.dead_end_token is not None and not bool(bitmask[row].any()):
            t = self.dead_end_token
            bitmask[row, t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance by the tokens a step kept. False if the grammar refused one (the mask was not applied)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return True  # a stop token ended it; the scheduler ends the request there
            if not self.matcher.accept_token(int(t)):
                return int(t) == self.dead_end_token  # the dead end's stop token ends the request
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
