"""Structured outputs through the Python API (``SamplingParams(structured_outputs=...)`` with ``LLM.generate``):
outputs follow their grammar, in batches mixed with unconstrained requests (whose tokens stay the same), with
speculative decoding (a draft the grammar forbids is rejected: outputs equal the non-speculative ones), compiled
once per distinct grammar, and bad constraints are typed errors at admission with nothing queued."""

from __future__ import annotations

import json
import re

from leanserve import LLM, SamplingParams, StructuredOutputsParams
from leanserve.errors import InvalidGrammarError, InvalidParameterError

import jsonschema
import pytest

from tests.conftest import assert_no_leaks

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "pets"]}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "prompt_lookup_min": 1}


def chat(llm: LLM, text: str) -> dict:
    tok = llm.get_tokenizer()
    return {"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), False)}


def greedy(max_tokens: int, **so) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**so) if so else None)


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded=loaded, kv_cache_memory=64 << 20, max_model_len=512)


@pytest.fixture(scope="module")
def llm_spec(loaded):
    return LLM(loaded=loaded, kv_cache_memory=64 << 20, max_model_len=512, speculative_config=SPEC)


CASES = [
    ("Describe a person who has pets, as JSON.", {"json": SCHEMA}, 80),
    ("Give a US phone number.", {"regex": r"\(\d{3}\) \d{3}-\d{4}"}, 20),
    ("Is the sky green?", {"choice": ["yes", "no", "not sure"]}, 10),
    ("Write a JSON object with the keys x and y set to 1 and 2.", {"json_object": True}, 60),
    ("Count to three.", {"grammar": 'root ::= "one" (", " ("two" | "three")){0,2}'}, 16),
]


def check(out, so: dict) -> None:
    text = out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop", (text, so)
    if "json" in so:
        jsonschema.validate(json.loads(text), so["json"])
    elif "regex" in so:
        assert re.fullmatch(so["regex"], text), text
    elif "choice" in so:
        assert text in so["choice"]
    elif "json_object" in so:
        assert isinstance(json.loads(text), dict), text
    else:
        assert re.fullmatch(r"one(, (two|three)){0,2}", text), text


def test_outputs_follow_their_grammar_in_a_mixed_batch(llm):
    prompts = [chat(llm, p) for p, _, _ in CASES]
    plain_prompt = chat(llm, "Name three rivers.")
    alone = llm.generate(plain_prompt, greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(prompts + [plain_prompt], [greedy(m, **so) for _, so, m in CASES] + [greedy(24)],
                        use_tqdm=False)
    for out, (_, so, _) in zip(outs, CASES, strict=False):
        check(out, so)
    assert outs[-1].outputs[0].token_ids == alone  # the unconstrained row is untouched by its neighbours' masks
    assert_no_leaks(llm.engine)
    assert not llm.engine.runner.grammars  # every matcher dropped with its request


def test_speculative_decoding_rejects_forbidden_drafts(llm, llm_spec):
    """n-gram drafts (copies of the prompt, often off-grammar) are verified under the grammar's masks: the
    output is the one decoded without speculation, and some drafts were accepted."""
    prompt = chat(llm, 'Copy this JSON exactly: {"name": "Bob", "age": 40, "pets": ["dog", "cat"]} and '
                  '{"name": "Ann", "age": 31, "pets": ["fish"]}')
    params = [greedy(80, json=SCHEMA), greedy(24, regex=r"[a-z ]{1,20}\.")]
    plain = llm.generate([prompt, prompt], params, use_tqdm=False)
    spec = llm_spec.generate([prompt, prompt], params, use_tqdm=False)
    for a, b, p in zip(plain, spec, params, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        check(b, {"json": SCHEMA} if p.structured_outputs.json else {"regex": r"[a-z ]{1,20}\."})
    stats = llm_spec.engine.get_stats()
    assert stats.spec_num_draft_tokens > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_no_leaks(llm_spec.engine)


def test_each_distinct_grammar_compiles_once(llm):
    grammars = llm.engine.admission.grammars
    before = grammars.num_compiled
    so = {"regex": r"[0-9]{2}"}
    outs = llm.generate([chat(llm, "A number?")] * 3, [greedy(4, **so)] * 3, use_tqdm=False)
    assert all(re.fullmatch(r"[0-9]{2}", o.outputs[0].text) for o in outs)
    assert grammars.num_compiled == before + 1
    llm.generate(chat(llm, "Another?"), greedy(4, **so), use_tqdm=False)
    assert grammars.num_compiled == before + 1


@pytest.mark.parametrize("so, fragment", [
    ({"json": {"type": "foo"}}, 'Unsupported type "foo"'),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 3}}, "minimum greater than maximum"),
    ({"regex": "(("}, "parenthesis is not closed"),
    ({"grammar": 'x ::= "a"'}, 'root rule with name "root" is not found'),
])
def test_invalid_constraints_are_typed_errors_at_admission(llm, so, fragment):
    with pytest.raises(InvalidGrammarError, match=re.escape(fragment)) as e:
        llm.generate("hi", greedy(4, **so), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("kwargs, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"choice": []}, "structured_outputs"),
    ({"choice": ["a", 1]}, "structured_outputs"),
    ({"json": 3}, "structured_outputs"),
])
def test_malformed_params_are_rejected_on_construction(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == param


@pytest.mark.parametrize("kwargs, param", [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")])
def test_grammar_decides_the_end(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"), **kwargs)
    assert e.value.param == param


def test_a_reused_request_id_keeps_its_new_grammar(llm):
    engine = llm.engine
    prompt = chat(llm, "A number?")["prompt_token_ids"]
    texts = []
    for regex in (r"[0-9]{3}", r"[a-c]{4}"):
        engine.add_request("same-id", prompt, greedy(8, regex=regex))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    texts.append(out.outputs[0].text)
    assert re.fullmatch(r"[0-9]{3}", texts[0]) and re.fullmatch(r"[a-c]{4}", texts[1]), texts
    assert not engine.runner.grammars
    assert_no_leaks(engine)


def test_a_draft_that_ends_the_grammar_with_a_stop_token(llm, llm_spec):
    """The n-gram proposer drafts '.' then <|im_end|> (copied from the chat prompt): accepting the stop token ends
    the matcher, and no mask may be asked of it after (that was an engine-step error)."""
    req = chat(llm, "Invent a person. Reply in JSON.")
    params = greedy(40, grammar='root ::= "The answer is " [0-9]+ "."')
    want = llm.generate([req], params, use_tqdm=False)[0].outputs[0]
    got = llm_spec.generate([req], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"The answer is [0-9]+\.", got.text) and got.token_ids == want.token_ids
    assert_no_leaks(llm_spec.engine)


@pytest.mark.parametrize("so", [{"regex": r"[^\s\S]"}, {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}])
def test_a_grammar_that_matches_nothing_ends_the_request_with_no_text(llm, so):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=10, structured_outputs=StructuredOutputsParams(**so))
    out = llm.generate([chat(llm, "Say something.")], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "" and out.finish_reason == "stop" and len(out.token_ids) == 1
    assert out.token_ids[0] in llm.get_tokenizer().stop_token_ids


@pytest.mark.parametrize("schema, fragment", [
    ({"not": {"type": "object"}}, "'not' is not supported (at #)"),
    ({"type": "array", "contains": {"const": 5}, "maxItems": 3}, "'contains' is not supported"),
    ({"anyOf": [{"allOf": [{"type": "integer"}, {"type": "string"}]}]}, "'allOf' is not supported (at #/anyOf/0)"),
    ({"type": "object", "properties": {"x": {"if": {}, "then": {}}}}, "'if' is not supported (at #/properties/x)"),
    ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
     "requires 'a' but allows no such property"),
])
def test_schema_keywords_the_engine_would_ignore_are_refused(llm, schema, fragment):
    with pytest.raises(InvalidGrammarError, match=re.escape(fragment)):
        llm.generate([chat(llm, "JSON please.")], greedy(8, json=schema), use_tqdm=False)
    assert_no_leaks(llm.engine)


def test_format_is_an_annotation_and_length_bounds_hold(llm):
    schema = {"type": "string", "format": "email", "maxLength": 10}
    out = llm.generate([chat(llm, "An email address as a JSON string.")], greedy(30, json=schema),
                       use_tqdm=False)[0].outputs[0]
    value = json.loads(out.text)
    assert out.finish_reason == "stop" and isinstance(value, str) and len(value) <= 10
