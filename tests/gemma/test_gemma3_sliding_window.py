"""Gemma 3 through the engine past its 512-token window: the local layers' own pool stays bounded by the window
(asserted at every step), outputs equal transformers', a prefix-cache hit gives the same tokens, no block leaks."""

from __future__ import annotations

from leanserve import LLM, SamplingParams
from leanserve.core.kv_cache_manager import cdiv

import pytest

from tests.conftest import assert_no_leaks
from tests.engine.test_greedy_vs_transformers import hf_greedy
from tests.model.test_logits_vs_transformers import PARAGRAPH

STEPS = 6
BUDGET = 256  # max_num_batched_tokens: the prompt is prefilled in chunks of 256


@pytest.fixture(scope="module")
def llm(gemma_loaded):
    return LLM(loaded=gemma_loaded, kv_cache_memory=256 << 20, max_model_len=4096, max_num_seqs=4,
               max_num_batched_tokens=BUDGET)


def run(llm, rid: str, ids: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of one request through LLMEngine.step, checking the local pins after every step; returns the
    tokens and the most local blocks the request pinned."""
    engine = llm.engine
    swa, bs = engine.kv.sliding_window, engine.config.block_size
    bound = cdiv(swa.window, bs) + 2 + cdiv(BUDGET, bs)
    engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    most, tokens = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        most = max(most, swa.pinned_blocks(rid))
        assert swa.pinned_blocks(rid) <= bound
        held = len(engine.kv.block_ids(rid))
        if held:  # blocks before the window are no longer pinned for the local layers
            assert swa.pinned_blocks(rid) <= min(held, bound)
    return tokens, most


def test_local_pool_bounded_and_outputs_exact(llm, gemma_loaded, gemma_hf):
    engine = llm.engine
    swa = engine.kv.sliding_window
    assert swa is not None and swa.window == 512
    ids = gemma_loaded.tokenizer.encode(PARAGRAPH * 30)[:1100]
    context_blocks = cdiv(len(ids) + STEPS, engine.config.block_size)
    # the local layers' caches have the local pool's blocks, the global layers' the main pool's
    caches = engine.runner.kv_caches
    cfg = engine.model_config
    assert {caches[i][0].shape[0] for i in range(cfg.num_layers) if cfg.is_sliding(i)} == {swa.num_local_blocks}
    assert {caches[i][0].shape[0] for i in range(cfg.num_layers) if not cfg.is_sliding(i)} == {engine.kv.num_blocks}
    assert swa.num_local_blocks < engine.kv.num_blocks

    # the runner's cost probe (speculative decoding's policy) writes block 0 outside the KV manager: it must run
    costs = engine.runner.measure_decode_cost([1, 2], repeats=1)
    assert set(costs) == {1, 2} and all(t > 0 for t in costs.values())
    cold, most = run(llm, "cold", ids)
    assert most < context_blocks  # the window, not the context: 1106 tokens need 70 blocks
    ref, _ = hf_greedy(gemma_hf, ids, STEPS)
    assert cold == ref
    assert swa.num_pinned == 0
    assert_no_leaks(engine)

    hits_before = engine.kv.prefix_cache_hits
    warm, _ = run(llm, "warm", ids)
    assert engine.kv.prefix_cache_hits - hits_before >= 512  # a hit longer than the window
    assert warm == cold
    assert swa.num_pinned == 0
    assert_no_leaks(engine)


def test_plan_counts_what_the_engine_allocates(llm):
    """``leanserve plan``'s arithmetic (:func:`leanserve.tools.plan.kv_pool_tokens`) gives the engine's own split
    of the same KV memory: the main pool's tokens and the local pool's bytes."""
    from leanserve.tools.plan import kv_pool_tokens

    engine = llm.engine
    swa, bs = engine.kv.sliding_window, engine.config.block_size
    cfg = engine.model_config
    tokens, local_bytes = kv_pool_tokens(cfg, 256 << 20, engine.config.kv_cache_dtype, engine.config.dtype, bs,
                                         engine.config.max_num_seqs, BUDGET)
    assert tokens == engine.kv.num_blocks * bs
    local_layers = sum(cfg.is_sliding(i) for i in range(cfg.num_layers))
    assert local_bytes == swa.num_local_blocks * bs * engine.kv_bytes_per_token * local_layers // cfg.num_layers
    assert tokens > (256 << 20) // engine.kv_bytes_per_token  # more than counting every layer
