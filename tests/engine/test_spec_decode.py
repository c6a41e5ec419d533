"""Speculative decoding (n-gram) on the default model: the output is the target model's, whatever it verifies.

Greedy outputs are token-identical with and without speculation (alone, in a batch, after prefix-cache hits,
with chunked prefill, under preemption); seeded sampling gives the same tokens and logprobs; stops inside an
accepted run end the request exactly where the plain decode ends it; no KV block leaks.
"""

from __future__ import annotations

import inspect
import textwrap

from leanserve import LLM, SamplingParams
from leanserve.config import SpeculativeConfig
from leanserve.errors import InvalidParameterError
from leanserve.loader import load_model

import pytest

from tests.conftest import assert_no_leaks

ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}  # verify every draft (deterministic)


def _source(obj) -> str:
    return textwrap.dedent(inspect.getsource(obj))


CODE = _source(textwrap.wrap)
DOC = _source(textwrap.TextWrapper)[:1600]
CONVS = [
    [{"role": "user", "content": f"Repeat this function exactly:\n\n{CODE}"}],
    [{"role": "user", "content": f"{DOC}\n\nQuote the first sentence of the docstring above."}],
    [{"role": "user", "content": f"{CODE}\n\nRename the function to wrap_text and show the whole code."}],
    [{"role": "user", "content": "Write a short product description for a steel water bottle."}],
]


@pytest.fixture(scope="module")
def loaded_auto():
    return load_model(None, quantization="auto")


def engines(loaded, spec=ALWAYS, **kw) -> tuple[LLM, LLM]:
    kw.setdefault("kv_cache_memory", 64 << 20)
    return LLM(loaded=loaded, **kw), LLM(loaded=loaded, speculative_config=spec, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def greedy(n: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_greedy_equal_alone_in_a_batch_and_after_prefix_hits(loaded_auto):
    base, spec = engines(loaded_auto)
    want = [tokens(base.chat(c, greedy(), use_tqdm=False))[0] for c in CONVS]
    assert [tokens(spec.chat(c, greedy(), use_tqdm=False))[0] for c in CONVS] == want  # alone
    assert tokens(spec.chat(CONVS, greedy(), use_tqdm=False)) == want  # one batch, prompts now cached
    stats = spec.engine.get_stats()
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1]
    assert stats.prefix_cache_hits > 0
    assert_no_leaks(spec.engine)


def test_greedy_equal_with_chunked_prefill_and_under_preemption(loaded_auto):
    tok = loaded_auto.tokenizer
    longest = max(len(tok.encode(tok.apply_chat_template(c), add_special_tokens=False)) for c in CONVS) + 64
    per_token = LLM(loaded=loaded_auto, kv_cache_memory=16 << 20).engine.kv_bytes_per_token
    # room for the longest request and a bit more, not for all four at once: some are preempted
    kw = {"max_num_batched_tokens": 96, "long_prefill_token_threshold": 64,
          "kv_cache_memory": int(longest * 1.5) * per_token}
    base, spec = engines(loaded_auto, **kw)
    want = tokens(base.chat(CONVS, greedy(64, ignore_eos=True), use_tqdm=False))
    got = tokens(spec.chat(CONVS, greedy(64, ignore_eos=True), use_tqdm=False))
    assert got == want
    assert spec.engine.get_stats().num_preemptions > 0 and spec.engine.get_stats().spec_num_drafts > 0
    assert_no_leaks(spec.engine)


def test_fp32_target_and_the_adaptive_policy_keep_greedy_output(loaded):
    base, spec = engines(loaded, spec={"method": "ngram"})
    assert tokens(spec.chat(CONVS[:2], greedy(32), use_tqdm=False)) == tokens(
        base.chat(CONVS[:2], greedy(32), use_tqdm=False))
    assert_no_leaks(spec.engine)


def test_seeded_sampling_gives_the_same_tokens_and_logprobs(loaded_auto):
    base, spec = engines(loaded_auto)
    for params in (SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=40, logprobs=3),
                   SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=24, presence_penalty=0.5, logprobs=0),
                   SamplingParams(temperature=0.8, seed=9, max_tokens=24, min_tokens=20, frequency_penalty=0.3)):
        a = base.chat(CONVS[0], params, use_tqdm=False)[0]
        b = spec.chat(CONVS[0], params, use_tqdm=False)[0]
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids and ca.text == cb.text
            if ca.logprobs is not None:
                for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
                    assert la.keys() == lb.keys()
                    assert max(abs(la[t].logprob - lb[t].logprob) for t in la) < 1e-4
    assert spec.engine.get_stats().spec_num_accepted_tokens > 0
    assert_no_leaks(spec.engine)


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(loaded_auto):
    base, spec = engines(loaded_auto)
    conv = CONVS[0]
    full = base.chat(conv, greedy(40, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    text = full.text
    cases = [greedy(n, ignore_eos=True, logprobs=1) for n in (1, 2, 3, 5, 8, 13)]
    cases += [greedy(40, stop_token_ids=[full.token_ids[i]], logprobs=1) for i in (3, 9, 17, 30)]
    cases += [greedy(40, stop=[text[i:i + 3]]) for i in (10, 25, 60) if len(text) > i + 3]
    cases += [greedy(40, stop=[text[i:i + 4]], include_stop_str_in_output=True) for i in (15, 40) if len(text) > i + 4]
    for params in cases:
        a = base.chat(conv, params, use_tqdm=False)[0].outputs[0]
        b = spec.chat(conv, params, use_tqdm=False)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason,
                                                                        a.stop_reason), params
        if a.logprobs is not None:
            assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]
    assert spec.engine.get_stats().spec_num_accepted_tokens > 0
    assert_no_leaks(spec.engine)


def test_a_request_at_the_context_limit_never_drafts_past_it(loaded_auto):
    tok = loaded_auto.tokenizer
    ids = tok.encode(tok.apply_chat_template(CONVS[0]), add_special_tokens=False)
    limit = len(ids) + 20
    base, spec = engines(loaded_auto, max_model_len=limit)
    a = base.generate({"prompt_token_ids": ids}, greedy(20, ignore_eos=True), use_tqdm=False)[0]
    b = spec.generate({"prompt_token_ids": ids}, greedy(20, ignore_eos=True), use_tqdm=False)[0]
    assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(b.outputs[0].token_ids) == 20
    unbounded = spec.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=None,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    assert len(ids) + len(unbounded.outputs[0].token_ids) == limit
    assert_no_leaks(spec.engine)


def test_per_request_opt_out_and_bad_configs(loaded_auto):
    _, spec = engines(loaded_auto)
    out = spec.chat(CONVS[0], greedy(24, speculative=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0 and spec.engine.get_stats().spec_num_drafts == 0
    for bad, field in (({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                       ({"quantization": "fp8"}, "quantization"), ({"draft": 1}, "draft"),
                       ({"share_kv_cache": "yes"}, "share_kv_cache"), ({"model": 5}, "model"),
                       ({"method": "ngram", "share_kv_cache": True}, "share_kv_cache"),
                       ({"method": "ngram", "model": "x.gguf"}, "model"),
                       ({"method": "draft_model", "prompt_lookup_max": 9}, "prompt_lookup_max"), ("{not json", None)):
        with pytest.raises(InvalidParameterError) as exc:
            SpeculativeConfig.parse(bad)
        assert exc.value.param == ("speculative_config" if field is None else f"speculative_config.{field}")


DRAFT_IDENTICAL = {"method": "draft_model", "quantization": "none", "num_speculative_tokens": 3, "adaptive": False}
DRAFT_4BIT = {"method": "draft_model", "quantization": "auto", "num_speculative_tokens": 4, "adaptive": False}


def test_a_draft_identical_to_the_target_is_always_accepted(loaded):
    base, spec = engines(loaded, spec=DRAFT_IDENTICAL, quantization="none")
    want = tokens(base.chat(CONVS[:2], greedy(32), use_tqdm=False))
    assert tokens(spec.chat(CONVS[:2], greedy(32), use_tqdm=False)) == want
    stats = spec.engine.get_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert_no_leaks(spec.engine)


@pytest.mark.parametrize("share", [None, False], ids=["target-cache", "own-cache"])
def test_the_4bit_self_draft_of_an_fp32_target_keeps_its_greedy_output(loaded, share):
    tok = loaded.tokenizer
    longest = max(len(tok.encode(tok.apply_chat_template(c), add_special_tokens=False)) for c in CONVS) + 32
    cfg = {**DRAFT_4BIT, "share_kv_cache": share}
    base, spec = engines(loaded, spec=cfg, quantization="none")
    # the self-draft reads the target's K/V by default (no cache of its own); with its own, each block holds both
    assert spec.engine.drafter.shares_target_cache is (share is None)
    assert spec.engine.kv_bytes_per_token == base.engine.kv_bytes_per_token * (1 if share is None else 2)
    want = tokens(base.chat(CONVS, greedy(32, ignore_eos=True), use_tqdm=False))
    assert [tokens(spec.chat(c, greedy(32, ignore_eos=True), use_tqdm=False))[0] for c in CONVS[:2]] == want[:2]
    assert tokens(spec.chat(CONVS, greedy(32, ignore_eos=True), use_tqdm=False)) == want  # batch, prefix hits
    # under preemption: room for about two requests at a time (both models' K/V share the blocks)
    tight = LLM(loaded=loaded, quantization="none", speculative_config=cfg,
                kv_cache_memory=int(longest * 1.5) * spec.engine.kv_bytes_per_token)
    assert tokens(tight.chat(CONVS, greedy(32, ignore_eos=True), use_tqdm=False)) == want
    assert tight.engine.get_stats().num_preemptions > 0
    stats = spec.engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens  # the same model at 4 bits agrees
    assert_no_leaks(spec.engine)
    assert_no_leaks(tight.engine)


def test_a_draft_with_another_vocabulary_is_refused_at_startup(loaded, monkeypatch):
    import dataclasses

    import leanserve.engine.llm_engine as llm_engine

    other = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, vocab_size=32000))
    monkeypatch.setattr(llm_engine, "load_model", lambda path, quantization="none": other)
    with pytest.raises(InvalidParameterError, match="vocabulary") as exc:
        LLM(loaded=loaded, kv_cache_memory=16 << 20, speculative_config=DRAFT_4BIT)
    assert exc.value.param == "speculative_config.model"
    monkeypatch.undo()
    for path in ("/nonexistent.gguf", __file__):  # missing, not a model: the error names the field
        with pytest.raises(InvalidParameterError, match="draft model cannot be loaded") as exc:
            LLM(loaded=loaded, kv_cache_memory=16 << 20, speculative_config={**DRAFT_4BIT, "model": path})
        assert exc.value.param == "speculative_config.model"


def test_sharing_the_target_cache_needs_its_shape(loaded, monkeypatch):
    import dataclasses

    import leanserve.engine.llm_engine as llm_engine

    other = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, num_kv_heads=1))
    monkeypatch.setattr(llm_engine, "load_model", lambda path, quantization="none": other)
    with pytest.raises(InvalidParameterError, match="KV cache shape") as exc:
        LLM(loaded=loaded, kv_cache_memory=16 << 20, speculative_config={**DRAFT_4BIT, "share_kv_cache": True})
    assert exc.value.param == "speculative_config.share_kv_cache"
    # by default a draft of another shape keeps its own cache
    spec = LLM(loaded=loaded, kv_cache_memory=16 << 20, speculative_config=DRAFT_4BIT)
    assert not spec.engine.drafter.shares_target_cache
