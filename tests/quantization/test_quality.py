"""Acceptance on the default model: int8 perplexity within 1% of the dequantized fp32 model, int4 (native Q4_1
and re-quantized) within 5%, int8 greedy first-token agreement >= 95%."""

from __future__ import annotations

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve import LLM, SamplingParams
from leanserve.loader import load_model
from leanserve.tools.perplexity import default_text, perplexity

import pytest

PROMPTS = 60  # windows of the text; agreement is measured on the first greedy token after each


@pytest.mark.slow
def test_quantized_quality_on_default_model() -> None:
    loaded = load_model(None, quantization="auto")  # native Q4_1 projections; each config is built from them
    ids = loaded.tokenizer.encode(default_text(), add_special_tokens=False)
    ppl_ids = ids[:1024]
    step = (len(ids) - 48) // PROMPTS
    prompts = [{"prompt_token_ids": ids[i * step:i * step + 48]} for i in range(PROMPTS)]
    params = SamplingParams(temperature=0, max_tokens=1)
    ppl, first = {}, {}
    for q in ("none", "int8", "int4", "auto"):
        llm = LLM(loaded=loaded, quantization=q, kv_cache_memory=64 << 20)
        ppl[q] = perplexity(llm.engine.model, ppl_ids, window=512)
        first[q] = [o.outputs[0].token_ids[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert abs(ppl["int8"] / ppl["none"] - 1) < 0.01, ppl
    assert abs(ppl["int4"] / ppl["none"] - 1) < 0.05 and abs(ppl["auto"] / ppl["none"] - 1) < 0.05, ppl
    agree = sum(a == b for a, b in zip(first["int8"], first["none"], strict=True)) / PROMPTS
    assert agree >= 0.95, agree
