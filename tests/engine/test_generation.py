"""End-to-end generation on the default model: seeds, stop strings, stop tokens, errors, logprobs, timings."""

from __future__ import annotations

from leanserve import LLM, SamplingParams
from leanserve.errors import ContextLengthExceededError, InvalidParameterError

import pytest

CHAT = [{"role": "user", "content": "Tell me a short story about a cat."}]


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_same_seed_same_text_different_seed_different_text(llm):
    p = dict(temperature=1.0, max_tokens=32, ignore_eos=True)
    a = llm.chat(CHAT, SamplingParams(seed=1, **p), use_tqdm=False)
    b = llm.chat(CHAT, SamplingParams(seed=1, **p), use_tqdm=False)
    c = llm.chat(CHAT, SamplingParams(seed=2, **p), use_tqdm=False)
    assert texts(a) == texts(b)
    assert texts(a) != texts(c)
    assert len(a[0].outputs[0].token_ids) == 32


def seeded_alone_and_in_batch(llm, seed: int = 7):
    """A seeded request's output alone and between two unseeded requests (logprobs of its 5 top tokens too)."""
    seeded = SamplingParams(seed=seed, temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=5)
    other = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    alone = llm.chat(CHAT, seeded, use_tqdm=False)[0].outputs[0]
    convs = [[{"role": "user", "content": "Hi!"}], CHAT, [{"role": "user", "content": "Name a color."}]]
    batch = llm.chat(convs, [other, seeded, other], use_tqdm=False)[1].outputs[0]
    return alone, batch


def test_seeded_request_alone_equals_in_batch_when_batch_invariant(loaded):
    """With batch_invariant the logits are bitwise independent of the batch, so the seeded text is the same."""
    llm = LLM(loaded=loaded, kv_cache_memory=64 << 20, batch_invariant=True)
    for seed in (7, 8):
        alone, batch = seeded_alone_and_in_batch(llm, seed)
        assert batch.token_ids == alone.token_ids
        assert batch.logprobs == alone.logprobs  # every top-5 logprob bitwise equal, at every step


def test_seeded_request_in_batch_is_numerically_close_by_default(llm):
    """Without batch_invariant, a row's GEMM kernel depends on the batch size (BLAS gemv alone, gemm in a
    batch), so logits differ in the last bits: the top-5 logprobs agree to 1e-4 at every step while the tokens
    agree. (A seeded draw that lands within that rounding of a CDF boundary can then differ.)"""
    alone, batch = seeded_alone_and_in_batch(llm)
    steps = 0
    for tok_a, tok_b, lp_a, lp_b in zip(alone.token_ids, batch.token_ids, alone.logprobs, batch.logprobs,
                                        strict=True):
        if tok_a != tok_b:
            break
        common = set(lp_a) & set(lp_b)
        assert len(common) >= 4
        assert max(abs(lp_a[t].logprob - lp_b[t].logprob) for t in common) < 1e-4
        steps += 1
    assert steps >= 8, steps


def test_batch_invariant_needs_float32(loaded):
    with pytest.raises(InvalidParameterError, match="batch_invariant"):
        LLM(loaded=loaded, dtype="bfloat16", kv_cache_memory=16 << 20, batch_invariant=True)


def test_stop_string_spanning_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = llm.generate("1, 2, 3, 4, 5, 6,", greedy, use_tqdm=False)[0].outputs[0].text
    assert " 9," in full, full  # the model keeps counting
    tok = llm.get_tokenizer()
    cut = full.index(" 9,")
    stop = " 9, 1"  # spans several tokens
    assert stop in full and len(tok.encode(stop, add_special_tokens=False)) >= 2
    out = llm.generate("1, 2, 3, 4, 5, 6,", SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate("1, 2, 3, 4, 5, 6,", SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                                           include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == full[:cut] + stop


def test_stop_on_first_token_gives_empty_text(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    first = llm.generate("1, 2, 3,", greedy, use_tqdm=False)[0].outputs[0]
    first_text = llm.get_tokenizer().decode(first.token_ids[:1])
    assert first_text
    out = llm.generate("1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=5, stop=[first_text]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "" and out.finish_reason == "stop"


def test_stop_token_ids_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 6
    stop_id = base.token_ids[2]
    out = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_chat_stops_at_end_of_turn_and_hides_it(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0.0, max_tokens=200),
                   use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.get_tokenizer().stop_token_ids
    assert "<|im_end|>" not in out.text and out.text.strip()


def test_min_tokens_suppresses_eos(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}],
                   SamplingParams(temperature=0.0, max_tokens=300, min_tokens=120), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 120


def test_logprobs_and_timings(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=5, logprobs=3),
                       use_tqdm=False)[0]
    choice = out.outputs[0]
    assert len(choice.logprobs) == 5
    for tid, entry in zip(choice.token_ids, choice.logprobs, strict=True):
        assert tid in entry and entry[tid].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3  # the chosen token is one of the top 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    m = out.metrics
    assert m.ttft > 0 and m.decode_time >= 0 and m.queue_time >= 0 and m.num_generation_tokens == 5


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=-1), "max_tokens"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(stop=[""]), "stop"), (dict(logprobs=21), "logprobs"), (dict(temperature=-0.5), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(n=0), "n"),
])
def test_invalid_parameters_raise_typed_errors(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_context_length_errors_leave_engine_clean(llm):
    tok = llm.get_tokenizer()
    too_long = {"prompt_token_ids": [tok.encode("hello")[0]] * (llm.engine.max_model_len + 10)}
    with pytest.raises(ContextLengthExceededError, match=str(llm.engine.max_model_len)):
        llm.generate(too_long, SamplingParams(max_tokens=4), use_tqdm=False)
    near = {"prompt_token_ids": [tok.encode("hello")[0]] * (llm.engine.max_model_len - 10)}
    with pytest.raises(ContextLengthExceededError, match="max_tokens|completion"):
        llm.generate(near, SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(InvalidParameterError):
        llm.generate({"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].token_ids


def test_n_choices_are_independent_and_indexed(llm):
    outs = llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12,
                                                          ignore_eos=True), use_tqdm=False)
    choices = outs[0].outputs
    assert [c.index for c in choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in choices}) == 3


def test_abort_frees_blocks_and_reports_abort_once(llm):
    engine = llm.engine
    engine.add_request("to-abort", "Once upon a time", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    seen = []
    for _ in range(3):
        seen += engine.step()
    assert engine.get_stats().num_running == 1
    engine.abort_request("to-abort")
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks
    final = engine.step()
    assert len(final) == 1 and final[0].finished
    out = final[0].outputs[0]
    assert out.finish_reason == "abort" and out.delta_token_ids == []  # no token repeated
    assert out.text == "".join(o.outputs[0].delta_text for o in seen) + out.delta_text
    assert not engine.has_unfinished_requests()


def test_min_tokens_beyond_the_context_is_rejected(llm):
    tok = llm.get_tokenizer()
    room = min(llm.engine.max_model_len, llm.engine.kv.num_tokens_capacity())
    near = {"prompt_token_ids": [tok.encode("hello")[0]] * (room - 20)}
    with pytest.raises(InvalidParameterError) as e:
        llm.generate(near, SamplingParams(max_tokens=None, min_tokens=100), use_tqdm=False)
    assert e.value.param == "min_tokens"


def test_invalid_unicode_prompt_is_a_typed_error(llm):
    with pytest.raises(InvalidParameterError) as e:
        llm.generate("\ud800 hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "prompt"


@pytest.mark.parametrize("prompt", [None, 5, [5], [{"text": "hi"}]])
def test_prompt_of_a_wrong_type_is_a_typed_error(llm, prompt):
    with pytest.raises(InvalidParameterError) as e:
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "prompt"


def test_n_with_the_largest_seed_does_not_overflow(llm):
    outs = llm.generate("Hi", SamplingParams(n=2, seed=2**64 - 1, temperature=1.0, max_tokens=4), use_tqdm=False)
    assert [c.index for c in outs[0].outputs] == [0, 1]


def test_max_model_len_beyond_the_models_context_is_rejected(loaded):
    ctx = loaded.config.max_position_embeddings
    with pytest.raises(InvalidParameterError, match=f"context of {ctx} tokens"):
        LLM(loaded=loaded, kv_cache_memory=16 << 20, max_model_len=ctx + 1)


@pytest.mark.parametrize(("mem", "message"), [(0, "must be >= 1"), (1000, "holds no block"), (-1, "must be >= 1")])
def test_kv_cache_memory_too_small_is_rejected(loaded, mem, message):
    """0 bytes is too little, not "the default" (only None means that)."""
    with pytest.raises(InvalidParameterError, match=message) as exc:
        LLM(loaded=loaded, kv_cache_memory=mem)
    assert exc.value.param == "kv_cache_memory"
