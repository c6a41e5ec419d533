"""``leanserve eval`` pieces: metrics against hand-computed values, config parsing, test-set validation, the
perplexity helper against a direct full-sequence forward, the gate, and a small end-to-end CLI run."""

from __future__ import annotations

import json
import math

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.errors import InvalidParameterError
from leanserve.model.llama import LlamaModel
from leanserve.tools.eval import ConfigResult, default_tests_path, load_test_set, parse_configs
from leanserve.tools.eval_metrics import rouge_l, score
from leanserve.tools.eval_report import format_table, gate_failures
from leanserve.tools.perplexity import default_text, perplexity, token_logprobs

import pytest
import torch


def test_metrics() -> None:
    assert score("exact", "  Paris\n", "paris") == 1.0 and score("exact", "Paris.", "Paris") == 0.0
    assert score("contains", "The capital is PARIS.", "paris") == 1.0
    assert score("contains", "red and blue", ["red", "green"]) == 0.0
    assert score("regex", "There are 7 days", r"\b7\b") == 1.0
    assert score("json_valid", 'Sure:\n```json\n{"name": "Alice"}\n```', {"name": "Alice"}) == 1.0
    assert score("json_valid", "{name: Alice}", None) == 0.0
    # LCS("the cat sat on the mat", "the cat on a mat") = "the cat on mat" (4): P = 4/6, R = 4/5
    p, r = 4 / 6, 4 / 5
    assert rouge_l("the cat sat on the mat", "the cat on a mat") == pytest.approx(2 * p * r / (p + r))
    assert rouge_l("a b", "c d") == 0.0
    with pytest.raises(InvalidParameterError, match="unknown metric"):
        score("bleu", "x", "y")


def test_parse_configs_and_test_sets(tmp_path) -> None:
    cfgs = parse_configs("none, int8,int4+kv-int8,kv-int8,auto+kv-float16")
    assert [(c.quantization, c.kv_cache_dtype) for c in cfgs] == [("none", "auto"), ("int8", "auto"),
                                                                   ("int4", "int8"), ("none", "int8"),
                                                                   ("auto", "float16")]
    with pytest.raises(InvalidParameterError, match="unknown config part 'fp8'"):
        parse_configs("none,fp8")
    cases = load_test_set(default_tests_path())
    assert len(cases) >= 10 and {c["metric"] for c in cases} == {"exact", "contains", "regex", "json_valid",
                                                                  "rougeL", "choice"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "expected": "b", "metric": "choice", "choices": ["a"]}) + "\n")
    with pytest.raises(InvalidParameterError, match="bad.jsonl:1"):
        load_test_set(str(bad))


def test_gate_and_table() -> None:
    results = [ConfigResult("none", 10.0, 0.80), ConfigResult("int8", 10.1, 0.78), ConfigResult("int4", 10.5, 0.70)]
    assert gate_failures(results, None) == []
    fails = gate_failures(results, 0.05)
    assert len(fails) == 1 and fails[0].startswith("int4")
    table = format_table(results)
    assert "+5.00%" in table and "+1.00%" in table


def test_perplexity_matches_full_forward(loaded) -> None:
    """Chunked scoring through the paged cache equals one full causal forward (fp32 cache), and the int8 cache
    stays within 1% of it."""
    model = LlamaModel(loaded.config, loaded.weights)
    ids = loaded.tokenizer.encode(default_text()[:3000], add_special_tokens=False)[:300]
    chunked = token_logprobs(model, ids, chunk=64)
    whole = token_logprobs(model, ids, chunk=1000)
    assert chunked.shape == (299,) and torch.allclose(chunked, whole, atol=2e-3)
    ppl = perplexity(model, ids, window=300)
    assert ppl == pytest.approx(math.exp(-float(whole.mean())), rel=1e-3)
    assert perplexity(model, ids, window=300, kv_cache_dtype="int8") == pytest.approx(ppl, rel=1e-2)


@pytest.mark.slow
def test_eval_cli_end_to_end(tmp_path) -> None:
    from leanserve.cli import main

    tests = tmp_path / "t.jsonl"
    tests.write_text(json.dumps({"prompt": "What is the capital of France?", "expected": "Paris",
                                 "metric": "contains"}) + "\n")
    out = tmp_path / "r.json"
    code = main(["eval", "--configs", "auto,int4", "--tests", str(tests), "--ppl-tokens", "128", "--ppl-window", "64",
                 "--agreement-prompts", "2", "--max-tokens", "16", "--json-out", str(out), "--max-drop", "1.0"])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert [r["name"] for r in results] == ["auto", "int4"] and results[0]["first_token_agreement"] == 1.0
