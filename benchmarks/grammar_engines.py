"""xgrammar vs llguidance on this CPU, with the default model's own tokenizer (its GGUF vocabulary).

For each engine and each grammar (a JSON schema, any JSON object, a regex): the time to build the tokenizer
info (once per model), to compile the grammar (once per distinct grammar), and per token of a valid output the
time to compute the allowed-token mask and to advance the matcher. The output is the leanserve tokenization of a
fixed valid text, walked token by token (every token is checked to be allowed). Usage:
    .venv/bin/python -m benchmarks.grammar_engines [--repeats 5]
Writes benchmarks/results/grammar_engines.json and prints a table. Nothing comes from a model hub.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from leanserve.loader import load_model

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "tags", "address"],
}
SCHEMA_TEXT = '{"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "W1"}}'
OBJECT_TEXT = '{"title": "The river", "pages": 312, "notes": [1.5, true, null, {"k": "v"}], "done": false}'
REGEX = r"\d{3}-\d{3}-\d{4} [A-Z][a-z]+ [A-Z][a-z]+"
REGEX_TEXT = "555-867-5309 Jenny Smith"
JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as xgrammar's
CASES = [("json_schema", SCHEMA, SCHEMA_TEXT), ("json_object", None, OBJECT_TEXT), ("regex", REGEX, REGEX_TEXT)]


def vocab(tok) -> tuple[list[bytes], list[int]]:
    """Every token's bytes (special tokens empty) and the stop ids, from leanserve's tokenizer."""
    tokens = [b"" if tok.is_special(i) else tok.token_bytes(i) for i in range(tok.vocab_size)]
    return tokens, sorted(tok.stop_token_ids)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        tokens, stops = vocab(tok)
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)

    def compile(self, kind: str, spec):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m) -> torch.Tensor:
        m.fill_next_token_bitmask(self.bitmask, 0)
        return self.bitmask[0]

    def consume(self, m, t: int) -> bool:
        return m.accept_token(t)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        tokens, stops = vocab(tok)

        class Wrapper:
            eos_token_id = tok.eos_token_id
            bos_token_id = tok.bos_token_id
            special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, s):
                return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, False)

        t0 = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapper()), eos_token=stops)
        self.setup_s = time.perf_counter() - t0
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)

    def compile(self, kind: str, spec):
        M = self.llg.LLMatcher
        if kind == "json_schema":
            grammar = M.grammar_from_json_schema(spec, defaults=JSON_OPTS)
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTS)
        else:
            grammar = M.grammar_from_regex(spec)
        err = M.validate_grammar(grammar, self.tokenizer)
        assert not err, err
        return grammar

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.tokenizer, compiled)
        assert not m.is_error(), m.get_error()
        return m

    def mask(self, m) -> torch.Tensor:
        self.llg.torch.fill_next_token_bitmask(m, self.bitmask, 0)
        return self.bitmask[0]

    def consume(self, m, t: int) -> bool:
        return m.consume_token(t)


def allowed(mask: torch.Tensor, t: int) -> bool:
    return bool((int(mask[t // 32]) >> (t % 32)) & 1)


def run(engine, tok, repeats: int) -> dict:
    out = {"setup_s": engine.setup_s}
    for kind, spec, text in CASES:
        ids = tok.encode(text, add_special_tokens=False)
        compile_s, mask_us, consume_us = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = engine.compile(kind, spec)
            compile_s.append(time.perf_counter() - t0)
            m = engine.matcher(compiled)
            for t in ids:
                t0 = time.perf_counter()
                mask = engine.mask(m)
                t1 = time.perf_counter()
                assert allowed(mask, t), f"{engine.name}/{kind}: token {t} ({tok.token_bytes(t)!r}) not allowed"
                ok = engine.consume(m, t)
                t2 = time.perf_counter()
                assert ok
                mask_us.append((t1 - t0) * 1e6)
                consume_us.append((t2 - t1) * 1e6)
            mask = engine.mask(m)  # at the end, EOS must be allowed
            assert allowed(mask, tok.eos_token_id), f"{engine.name}/{kind}: EOS not allowed at the end"
        out[kind] = {"tokens": len(ids), "compile_ms": 1e3 * statistics.median(compile_s),
                     "mask_us_mean": statistics.fmean(mask_us), "mask_us_median": statistics.median(mask_us),
                     "mask_us_p90": _p90(mask_us), "mask_us_max": max(mask_us),
                     "consume_us_median": statistics.median(consume_us)}
    return out


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[int(0.9 * (len(xs) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/grammar_engines.json")
    args = ap.parse_args()
    tok = load_model().tokenizer
    torch.set_num_threads(1)
    results = {}
    for cls in (XGrammar, LLGuidance):
        results[cls.name] = run(cls(tok), tok, args.repeats)
    print(f"vocab {tok.vocab_size} tokens; setup = tokenizer info; per token: mask mean / median / p90 / max, consume")
    print(f"{'engine':<11} {'setup ms':>9} {'grammar':<12} {'compile ms':>10} {'mask µs':>26} {'consume µs':>10}")
    for name, r in results.items():
        for kind, *_ in CASES:
            c = r[kind]
            print(f"{name:<11} {1e3 * r['setup_s']:>9.1f} {kind:<12} {c['compile_ms']:>10.2f} "
                  f"{c['mask_us_mean']:>6.1f} {c['mask_us_median']:>6.1f} {c['mask_us_p90']:>6.1f} "
                  f"{c['mask_us_max']:>6.0f} "
                  f"{c['consume_us_median']:>10.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
