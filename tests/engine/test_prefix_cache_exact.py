"""In the default configuration (the Q4_1 file's native 4-bit weights, bf16 activations in the packed kernels) a
prompt's output does not depend on what the prefix cache held or how the prompt was chunked: every recomputed
tail and every chunk is long enough to run through the same kernels as a cold prefill (PREFILL_MIN_ROWS)."""

from __future__ import annotations

from leanserve import LLM, SamplingParams
from leanserve.loader import load_model

import pytest

STORY = ("The lighthouse keeper climbed the stairs every evening, counting the steps and listening to the sea. "
         "One night the lamp would not light, and the ships far out in the dark waited for a signal. ")


@pytest.fixture(scope="module")
def loaded_auto():
    return load_model(None, quantization="auto")


def run(llm: LLM, prompt_ids: list[int]):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]


def same(a, b) -> bool:
    """Same tokens and bitwise the same top-5 logprobs at every step."""
    return a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_cold_full_hit_partial_hit_and_no_cache_are_bitwise_equal(loaded_auto, kv_cache_dtype):
    llm = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.model.quantization == "auto" and llm.engine.config.quantization == "auto"
    tok = llm.get_tokenizer()
    ids = tok.encode(STORY * 3)
    for n in (24, 33, 34, 70):  # hits leave tails of 8, 17, 18, 22 tokens; a cold 34 ends in a 2-row query block
        prompt = ids[:n]
        cold = run(llm, prompt)
        hit = run(llm, prompt)
        assert hit.num_cached_tokens > 0 and hit.num_cached_tokens % 16 == 0
        assert same(cold, hit), n
    shared = ids[:40]
    run(llm, shared + tok.encode(" Then the storm came."))  # caches the shared blocks only
    partial = run(llm, shared + tok.encode(" The keeper smiled."))
    assert 0 < partial.num_cached_tokens < 40
    off = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20, enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype)
    assert same(partial, run(off, shared + tok.encode(" The keeper smiled.")))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_chunked_prompt_equals_unchunked_in_the_default_config(loaded_auto, kv_cache_dtype):
    tok_ids = None
    outs = []
    for threshold, budget in ((0, None), (256, 2048), (64, 100)):
        llm = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20, long_prefill_token_threshold=threshold,
                  max_num_batched_tokens=budget, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
        tok_ids = tok_ids or llm.get_tokenizer().encode(STORY * 4)[:258]  # 256 + 2: no 2-token last piece
        outs.append(run(llm, tok_ids))
    assert same(outs[0], outs[1]) and same(outs[0], outs[2])


def test_seeded_n_choices_repeat_exactly(loaded_auto):
    """A fresh-user trial: the same seeded n=3 chat request gave other choices once its prompt was cached."""
    llm = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8)
    msgs = [{"role": "user", "content": "Describe a sunny beach"}]
    first = llm.chat(msgs, params, use_tqdm=False)[0]
    again = llm.chat(msgs, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


def test_prompt_arriving_among_running_requests_equals_alone(loaded_auto):
    """A prompt that arrives while other requests hold all but one token of a step's budget does not start with a
    1-token piece (which runs as a decode row, through other kernels than a chunk): it waits a step, and its output
    is bitwise what it gets alone."""
    llm = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20, max_num_batched_tokens=24, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    words = tok.encode(STORY * 4)
    prompt = words[:48]
    alone = run(llm, prompt)
    engine, pieces = llm.engine, []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        pieces.extend(x.num_new_tokens for x in out.scheduled if x.request.request_id == "p")
        return out

    engine.scheduler.schedule = recording
    engine.add_request("decoding", words[60:83], SamplingParams(max_tokens=30, ignore_eos=True))  # 23 tokens
    engine.step()
    # next steps: 1 decode + 23 of "prefilling", then 1 + its last 22: one token of budget left for "p"
    engine.add_request("prefilling", words[90:135], SamplingParams(max_tokens=30, ignore_eos=True))  # 45
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert pieces[0] >= 8 and sum(pieces[:3]) >= 48, pieces  # no 1-token first piece
    assert same(alone, outs["p"])


def test_int8_prefill_rows_keep_the_prefix_cache_and_chunking_promises(loaded_auto):
    """``--prefill-gemm int8``: a prompt token is computed by the int8 kernel however it arrives, so a prefix-cache
    hit, a chunked prefill and a cold one give bitwise the same output."""
    llm = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20, prefill_gemm="int8")
    if llm.engine.prefill_gemm != "int8":
        pytest.skip("no native kernels")
    ids = llm.get_tokenizer().encode(STORY * 4)
    for n in (34, 70):
        cold = run(llm, ids[:n])
        hit = run(llm, ids[:n])
        assert hit.num_cached_tokens > 0 and same(cold, hit), n
    chunked = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20, long_prefill_token_threshold=64,
                  max_num_batched_tokens=100, enable_prefix_caching=False, prefill_gemm="int8")
    whole = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20, enable_prefix_caching=False, prefill_gemm="int8")
    assert same(run(chunked, ids[:258]), run(whole, ids[:258]))
    lane = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20, enable_prefix_caching=False, prefill_gemm="lane")
    assert run(lane, ids[:258]).outputs[0].logprobs != run(whole, ids[:258]).outputs[0].logprobs  # int8 did run
