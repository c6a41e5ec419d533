"""Paged KV cache, prefix caching and the continuous-batching scheduler on the default model (fp32, greedy).

Outputs must not depend on batching, chunking, prefix hits or preemption: each case compares token ids with the
same request served alone.
"""

from __future__ import annotations

import time

from leanserve import LLM, SamplingParams
from leanserve.errors import KVCapacityError

import pytest

from tests.conftest import assert_no_leaks

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "Describe a sunset in one sentence.",
    "Give me a tip for better sleep.",
    "What does a compiler do?",
]
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
STORY = ("The river wound through the valley, past fields of barley and old stone walls. In the evening the "
         "fishermen pulled their boats onto the gravel and talked about the weather, the price of bread and the new "
         "bridge that the town council had promised for years. ")


def chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def run_engine(engine, requests: dict[str, tuple[list[int], SamplingParams]], join_at: dict[str, int] | None = None,
               ) -> dict[str, list[int]]:
    """Drive the engine step by step; request ``r`` is added at step ``join_at[r]`` (default 0)."""
    join_at = join_at or {}
    pending = dict(requests)
    results: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        for rid in [r for r in pending if join_at.get(r, 0) <= step]:
            ids, params = pending.pop(rid)
            engine.add_request(rid, ids, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    return results


@pytest.fixture(scope="module")
def solo(llm):
    """Each prompt served alone."""
    return {p: llm.generate({"prompt_token_ids": chat_ids(llm, p)}, GREEDY_64, use_tqdm=False)[0].outputs[0].token_ids
            for p in PROMPTS}


def test_batch_of_eight_equals_solo(llm, solo):
    outs = llm.generate([{"prompt_token_ids": chat_ids(llm, p)} for p in PROMPTS], GREEDY_64, use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == solo[p], p


def test_joining_a_running_generation_equals_solo(llm, solo):
    engine = llm.engine
    reqs = {"long": (chat_ids(llm, "Tell me a long story."), SamplingParams(temperature=0, max_tokens=200,
                                                                             ignore_eos=True))}
    join = {}
    for i, p in enumerate(PROMPTS):
        reqs[p] = (chat_ids(llm, p), GREEDY_64)
        join[p] = 3 + 11 * i  # each joins while the long one (and earlier joiners) are decoding
    got = run_engine(engine, reqs, join)
    for p in PROMPTS:
        assert got[p] == solo[p], p


def test_chunked_prefill_gives_identical_output(loaded):
    llm0 = LLM(loaded=loaded, kv_cache_memory=128 << 20, max_num_batched_tokens=None)
    ids = llm0.get_tokenizer().encode(STORY * 40)[:1600]
    assert len(ids) == 1600
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = llm0.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leaks(llm0.engine)
    del llm0
    for budget in (17, 64, 512):
        llm = LLM(loaded=loaded, kv_cache_memory=128 << 20, max_num_batched_tokens=budget,
                  long_prefill_token_threshold=0)
        assert llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids == ref, budget
        assert_no_leaks(llm.engine)


def test_prefix_cache_hits_do_not_change_output(loaded):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    shared = STORY * 3
    off = LLM(loaded=loaded, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    tok = off.get_tokenizer()
    a = tok.encode(shared + "Question: what did the fishermen talk about?")
    b = tok.encode(shared + "Question: what was promised?")
    ref_a = off.generate({"prompt_token_ids": a}, params, use_tqdm=False)[0]
    ref_b = off.generate({"prompt_token_ids": b}, params, use_tqdm=False)[0]
    assert ref_a.num_cached_tokens == 0
    del off
    on = LLM(loaded=loaded, kv_cache_memory=64 << 20)
    cold = on.generate({"prompt_token_ids": a}, params, use_tqdm=False)[0]
    hit = on.generate({"prompt_token_ids": a}, params, use_tqdm=False)[0]
    partial = on.generate({"prompt_token_ids": b}, params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == hit.outputs[0].token_ids == ref_a.outputs[0].token_ids
    assert partial.outputs[0].token_ids == ref_b.outputs[0].token_ids
    bs = on.engine.config.block_size
    for out, prompt in ((hit, a), (partial, b)):
        assert 0 < out.num_cached_tokens < len(prompt) and out.num_cached_tokens % bs == 0
    assert hit.num_cached_tokens == (len(a) - 1) // bs * bs  # all full blocks but the last token's
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert partial.num_cached_tokens == common // bs * bs
    stats = on.engine.get_stats()
    assert stats.prefix_cache_queries == 2 * len(a) + len(b)
    assert stats.prefix_cache_hits == hit.num_cached_tokens + partial.num_cached_tokens
    # a prompt of exactly two blocks, twice
    two = a[: 2 * bs]
    first = on.generate({"prompt_token_ids": two}, params, use_tqdm=False)[0]
    second = on.generate({"prompt_token_ids": two}, params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert second.num_cached_tokens == bs
    assert_no_leaks(on.engine)


def test_preemption_keeps_outputs_exact(loaded):
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    big = LLM(loaded=loaded, kv_cache_memory=64 << 20)
    tok = big.get_tokenizer()
    prompts = [tok.encode(f"Story number {i}. " + STORY * 4)[:200] for i in range(8)]
    solo = [big.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    del big
    # 8 x 500 tokens need 256 blocks of 16; the pool has 110
    small = LLM(loaded=loaded, kv_cache_memory=110 * 16 * loaded.config.kv_bytes_per_token)
    assert small.engine.kv.num_blocks == 110
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == solo[i], i
    assert small.engine.get_stats().num_preemptions > 0
    assert_no_leaks(small.engine)


def test_oversized_request_fails_fast_and_others_proceed(loaded):
    llm = LLM(loaded=loaded, kv_cache_memory=20 * 16 * loaded.config.kv_bytes_per_token)  # 320 tokens
    engine = llm.engine
    ids = llm.get_tokenizer().encode(STORY * 10)[:400]
    assert len(ids) == 400
    t0 = time.perf_counter()
    with pytest.raises(KVCapacityError, match="320 tokens"):
        engine.add_request("huge", ids, SamplingParams(max_tokens=8))
    assert time.perf_counter() - t0 < 1.0
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_no_leaks(engine)


def test_short_requests_are_not_starved_by_long_ones(loaded):
    llm = LLM(loaded=loaded, kv_cache_memory=512 << 20)
    engine = llm.engine
    tok = llm.get_tokenizer()
    longs = [tok.encode(f"Document {i}. " + STORY * 25)[:1200] for i in range(6)]
    shorts = [chat_ids(llm, p) for p in PROMPTS[:6]]
    p_long = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    p_short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate({"prompt_token_ids": shorts[0]}, p_short, use_tqdm=False)  # warm-up
    solo_ttft = []
    for s in shorts:  # best of two, with the prefix cache off the path
        runs = []
        for _ in range(2):
            engine.kv.pool.reset_prefix_cache()
            runs.append(llm.generate({"prompt_token_ids": s}, p_short, use_tqdm=False)[0].metrics.ttft)
        solo_ttft.append(min(runs))
    engine.kv.pool.reset_prefix_cache()
    ttft: dict[str, float] = {}
    for i in range(6):  # long ones first: the worst case for FCFS
        engine.add_request(f"long{i}", longs[i], p_long)
    for i in range(6):
        engine.add_request(f"short{i}", shorts[i], p_short)
    finished = set()
    first_step: dict[str, int] = {}  # the step (1-based) that gave each short request its first token
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.request_id.startswith("short") and out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = out.metrics.ttft
                first_step[out.request_id] = steps
            if out.finished:
                finished.add(out.request_id)
    assert finished == {f"long{i}" for i in range(6)} | {f"short{i}" for i in range(6)}
    worst = max(ttft[f"short{i}"] / solo_ttft[i] for i in range(6))
    print(f"short TTFT solo {[round(t, 3) for t in solo_ttft]} s; with 6 long prompts "
          f"{[round(ttft[f'short{i}'], 3) for i in range(6)]} s; worst ratio {worst:.1f}x; first tokens at "
          f"steps {sorted(first_step.values())} of {steps}")
    # The scheduling itself, free of timing noise: under FCFS the 7,200 long-prompt tokens would fill the first
    # ceil(7200 / 2048) = 4 steps' budgets; with long prompts capped per step every short request gets its first
    # token in the first step. The wall-clock ratio (~7x on an idle machine: that step also carries a 256-token
    # chunk of a long prompt) is printed, not asserted: timing belongs in benchmarks.
    assert max(first_step.values()) == 1
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def loaded_auto():
    """The default model with its GGUF matrices kept native (lane layout: the prefill GEMM modes apply)."""
    from leanserve.loader import load_model

    return load_model(None, quantization="auto")


@pytest.mark.parametrize("prefill_gemm", ["int8", "bf16"])
def test_preempted_requests_continue_as_alone_with_a_coarse_prefill_gemm(loaded_auto, prefill_gemm):
    """Under a prefill GEMM other than the decode rows' kernel, a preempted request's generated tokens are
    recomputed as decode rows (``recomputed_rows``), so the greedy text equals the request's solo text (a fresh-user
    trial: 3 of 8 texts differed when they were recomputed through the int8 kernel)."""
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    prompts = [f"Write a long story about a dragon number {i} who lives in a castle near the sea and loves to"
               for i in range(8)]
    loaded = loaded_auto
    big = LLM(loaded=loaded, kv_cache_memory=64 << 20, enable_prefix_caching=False, prefill_gemm=prefill_gemm)
    if big.engine.prefill_gemm != prefill_gemm:
        pytest.skip(f"{prefill_gemm} does not run in this build")
    solo = [big.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    del big
    small = LLM(loaded=loaded, kv_cache_memory=22 * 16 * loaded.config.kv_bytes_per_token,
                enable_prefix_caching=False, prefill_gemm=prefill_gemm)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == solo
    assert_no_leaks(small.engine)
