"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal transformers' log-softmax of the same prompt (the same
GGUF file) within 1e-3: cold, after a full and a partial prefix-cache hit, under chunked prefill, alone and batched.
In the default configuration (native 4-bit weights) they are bitwise the same whatever the cache state, the chunking
and the batch."""

from __future__ import annotations

from leanserve import LLM, SamplingParams
from leanserve.errors import InvalidParameterError
from leanserve.loader import load_model

import pytest
import torch

TOL = 1e-3
PARAGRAPH = ("The river wound through the valley, past fields of barley and old stone walls. In the evening the "
             "fishermen pulled their boats onto the gravel and talked about the weather, the price of bread and "
             "the new bridge that the town council had promised for years. ")
TEXTS = ["What is the capital of France? The capital of France is Paris.",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
         PARAGRAPH * 3]


@pytest.fixture(scope="module")
def prompts(loaded):
    ids = [loaded.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[2]) > 100
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    """transformers' log_softmax at every position of each prompt: [len, vocab] float32."""
    with torch.no_grad():
        return [torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


@pytest.fixture(scope="module")
def loaded_auto():
    return load_model(None, quantization="auto")


def params(n_top: int = 5, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 2, "ignore_eos": True, "prompt_logprobs": n_top, **kw})


def gen(llm: LLM, prompts: list[list[int]], p: SamplingParams | list[SamplingParams]):
    return llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)


def check_against_reference(out, prompt: list[int], ref: torch.Tensor, n_top: int = 5) -> None:
    """Every prompt token's logprob, rank and top-N alternatives against transformers' log-softmax."""
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    worst = 0.0
    for i in range(1, len(prompt)):
        entry, row = plp[i], ref[i - 1]
        assert next(iter(entry)) == prompt[i], "the prompt token comes first, as vLLM"
        got = entry[prompt[i]]
        worst = max(worst, abs(got.logprob - row[prompt[i]].item()))
        ref_rank = int((row > row[prompt[i]]).sum()) + 1
        assert abs(got.rank - ref_rank) <= max(2, ref_rank // 100), (i, got.rank, ref_rank)  # near-ties may swap
        top = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank <= n_top))
        assert len(top) == n_top
        for _, tid, lp in top:
            assert abs(lp - row[tid].item()) <= TOL
        assert abs(top[0][2] - row.max().item()) <= TOL
    assert worst <= TOL, worst


def plp_values(out) -> list:
    return [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in out.prompt_logprobs]


def test_cold_prompt_logprobs_match_transformers(llm, prompts, reference):
    outs = gen(llm, prompts[:1], params())
    check_against_reference(outs[0], prompts[0], reference[0])
    for i in (1, 2):
        out = gen(llm, [prompts[i]], params())[0]
        assert out.num_cached_tokens == 0
        check_against_reference(out, prompts[i], reference[i])
    # the output tokens' own logprobs are unchanged by asking for the prompt's
    plain = gen(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=2))[0]
    both = gen(llm, [prompts[0]], params(logprobs=2))[0]
    assert plain.outputs[0].token_ids == both.outputs[0].token_ids
    assert plain.prompt_logprobs is None and both.outputs[0].logprobs == plain.outputs[0].logprobs


def test_full_and_partial_prefix_cache_hits_do_not_lose_them(llm, prompts, reference):
    long = prompts[2]
    cold = gen(llm, [long], params())[0]
    warm = gen(llm, [long], SamplingParams(temperature=0, max_tokens=1))[0]  # the prompt's blocks are cached now
    assert warm.num_cached_tokens >= 96
    full = gen(llm, [long], params())[0]
    assert full.num_cached_tokens == 0  # no lookup: every position is computed (vLLM's rule)
    assert plp_values(full) == plp_values(cold)
    check_against_reference(full, long, reference[2])
    prefix = long[:70]
    gen(llm, [prefix], SamplingParams(temperature=0, max_tokens=1))
    partial = gen(llm, [long], params())[0]
    assert plp_values(partial) == plp_values(cold)
    # a request without prompt logprobs still gets its hit
    assert gen(llm, [long], SamplingParams(temperature=0, max_tokens=1))[0].num_cached_tokens >= 96


def test_chunked_prefill(loaded, prompts, reference):
    llm = LLM(loaded=loaded, kv_cache_memory=64 << 20, max_num_batched_tokens=40, long_prefill_token_threshold=24)
    out = gen(llm, [prompts[2]], params())[0]
    check_against_reference(out, prompts[2], reference[2])


def test_batched_with_other_requests(llm, prompts, reference):
    others = [SamplingParams(temperature=0.8, seed=1, max_tokens=6), SamplingParams(max_tokens=3, logprobs=1)]
    batch = [prompts[0], prompts[1], prompts[2], prompts[1]]
    outs = gen(llm, batch, [params(), others[0], params(n_top=2), others[1]])
    check_against_reference(outs[0], prompts[0], reference[0])
    check_against_reference(outs[2], prompts[2], reference[2], n_top=2)
    assert outs[1].prompt_logprobs is None and outs[3].prompt_logprobs is None


def test_n_choices_and_prompt_of_one_token(llm, prompts, reference):
    out = gen(llm, [prompts[0]], params(n=2, temperature=0.7, seed=3))[0]
    assert len(out.outputs) == 2
    check_against_reference(out, prompts[0], reference[0])
    one = gen(llm, [prompts[0][:1]], params())[0]
    assert one.prompt_logprobs == [None]


def test_bitwise_invariant_in_the_default_config(loaded_auto, prompts):
    """Native 4-bit weights: cold, after a hit, chunked and batched, the same bits."""
    base = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20)
    long = prompts[2]
    cold = plp_values(gen(base, [long], params())[0])
    gen(base, [long], SamplingParams(max_tokens=1))
    assert plp_values(gen(base, [long], params())[0]) == cold
    batched = gen(base, [prompts[0], long, prompts[1]], [SamplingParams(max_tokens=4), params(),
                                                         SamplingParams(max_tokens=2, prompt_logprobs=1)])
    assert plp_values(batched[1]) == cold
    chunked = LLM(loaded=loaded_auto, kv_cache_memory=64 << 20, max_num_batched_tokens=40,
                  long_prefill_token_threshold=24, enable_prefix_caching=False)
    assert plp_values(gen(chunked, [long], params())[0]) == cold


def test_requests_that_do_not_ask_compute_no_prompt_logits(llm, prompts, monkeypatch):
    import leanserve.worker.model_runner as mr

    def fail(*args, **kwargs):
        raise AssertionError("prompt logits computed for a request that did not ask")

    monkeypatch.setattr(mr, "compute_prompt_logprobs", fail)
    out = gen(llm, [prompts[2]], SamplingParams(max_tokens=2, logprobs=3))[0]
    assert out.prompt_logprobs is None and len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("value", [-1, 21, True, 1.0, "2"])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(InvalidParameterError) as exc:
        SamplingParams(prompt_logprobs=value)
    assert exc.value.param == "prompt_logprobs"


def test_preempted_and_recomputed_request_keeps_them(loaded, prompts, reference):
    """A pool too small for both requests: one is preempted mid-generation and recomputed from scratch; its prompt
    logprobs are kept once (the recompute's are the same positions) and still match."""
    llm = LLM(loaded=loaded, kv_cache_memory=9 * 16 * loaded.config.num_layers * 2 * loaded.config.num_kv_heads
              * loaded.config.head_dim * 4, max_num_batched_tokens=64)
    assert llm.engine.kv.num_blocks == 9
    long = prompts[2][:100]
    outs = gen(llm, [long, long], [params(max_tokens=16), params(max_tokens=16)])
    assert llm.engine.get_stats().num_preemptions > 0
    for out in outs:
        check_against_reference(out, long, reference[2][:100])
