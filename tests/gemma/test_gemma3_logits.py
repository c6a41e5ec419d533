"""Gemma 3 270M logits equal transformers' Gemma3ForCausalLM on the same GGUF file (within 1e-3 x max |logit|):
4 prompts up to 300 tokens alone and in one batch, a step mixing a decode, a chunked prefill and fresh prefills,
and, past the 512-token sliding window, a chunked prefill and decodes (the local layers see the window only)."""

from __future__ import annotations

from leanserve.model.gemma3 import Gemma3Model

import pytest
import torch

from tests.model.test_logits_vs_transformers import PARAGRAPH, Stepper, assert_close, make_req


@pytest.fixture(scope="module")
def model(gemma_loaded):
    return Gemma3Model(gemma_loaded.config, gemma_loaded.weights, quantization="auto", max_position=2048)


@pytest.fixture(scope="module")
def prompts(gemma_loaded):
    tok = gemma_loaded.tokenizer
    texts = ["Hello, how are you doing today", "What is the capital of France?",
             "def fibonacci(n):\n    if n < 2:\n        return n", PARAGRAPH * 8]
    ids = [tok.encode(t) for t in texts]
    ids[3] = ids[3][:300]
    assert len(ids[3]) == 300 and all(len(x) >= 5 for x in ids)
    return ids


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


@pytest.fixture(scope="module")
def reference(gemma_hf, prompts):
    return [hf_last_logits(gemma_hf, p) for p in prompts]


def test_config_is_gemma3(model):
    cfg = model.config
    assert cfg.architecture == "gemma3" and cfg.sliding_window == 512 and cfg.tie_word_embeddings
    assert [i for i in range(cfg.num_layers) if not cfg.is_sliding(i)] == [5, 11, 17]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256.0)


def test_each_prompt_alone(model, prompts, reference):
    for i, p in enumerate(prompts):
        assert_close(Stepper(model).step([(make_req("r", p), len(p))])["r"], reference[i])


def test_one_forward_mixing_all_prompts(model, prompts, reference):
    reqs = [make_req(str(i), p) for i, p in enumerate(prompts)]
    out = Stepper(model).step([(r, r.num_tokens) for r in reqs])
    for i in range(4):
        assert_close(out[str(i)], reference[i])


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch-path"])
def test_mixed_decode_chunked_and_fresh_prefill(model, prompts, reference, native):
    s = Stepper(model, native=native)
    r0, r1, r2, r3 = (make_req(str(i), p) for i, p in enumerate(prompts))
    s.step([(r0, r0.num_tokens - 1), (r3, 137)])
    out = s.step([(r0, 1), (r3, r3.num_tokens - 137), (r1, r1.num_tokens), (r2, r2.num_tokens)])
    for i in range(4):
        assert_close(out[str(i)], reference[i])


def test_past_the_sliding_window(model, gemma_loaded, gemma_hf):
    """A 700-token prompt: one prefill (band mask), then chunks of 300 / 250 / 150 across the window's edge, then
    decodes at positions 700-702; every result equals the reference on the same prefix. Masking the window off
    would change the logits: the same prompt with the local layers made global differs by far more."""
    ids = gemma_loaded.tokenizer.encode(PARAGRAPH * 20)[:703]
    assert len(ids) == 703
    with torch.no_grad():  # row n - 1 of one causal forward: the logits after the first n tokens
        all_logits = gemma_hf(torch.tensor([ids])).logits[0].float()
    refs = {n: all_logits[n - 1] for n in (700, 701, 702, 703)}
    whole = Stepper(model, num_blocks=128).step([(make_req("w", ids[:700]), 700)])["w"]
    assert_close(whole, refs[700])
    s = Stepper(model, native=True, num_blocks=128)
    req = make_req("c", ids[:700])
    for n in (300, 250, 149):
        s.step([(req, n)])
    for n in (700, 701, 702, 703):
        assert_close(s.step([(req, 1)])["c"], refs[n])
        if n < 703:
            req.output_token_ids.append(ids[n])  # as if sampled: the next step decodes it
    # the window matters here: attending to every key gives other logits
    full = Gemma3Model(model.config.__class__(**{**vars(model.config), "layer_types": tuple(
        "full_attention" for _ in model.config.layer_types)}), gemma_loaded.weights, quantization="auto",
        max_position=2048)
    wrong = Stepper(full, num_blocks=128).step([(make_req("f", ids[:700]), 700)])["f"]
    assert (wrong - refs[700]).abs().max() > 100 * 1e-3 * refs[700].abs().max()
