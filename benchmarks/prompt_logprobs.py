"""Prompt logprobs: their agreement with transformers and what they cost, on the default model.

For each weight setting (``auto``: the GGUF file's native 4-bit weights, the server's default; ``none``: fp32):
  * agreement: the largest and mean |difference| between leanserve's prompt logprobs and transformers'
    ``log_softmax`` of the same prompt (``LlamaForCausalLM`` loading the same GGUF file), over 4 prompts of 20 to
    300 tokens, every prompt token;
  * cost: the wall time of a batch of 64 lm-eval-style loglikelihood requests (a ~25-token question and answer,
    ``max_tokens=1``, ``logprobs=1``) without and with ``prompt_logprobs=1`` (the best of 3 runs each).

Usage:
    .venv/bin/python -m benchmarks.prompt_logprobs
Writes benchmarks/results/prompt_logprobs.json and prints a table.
"""

from __future__ import annotations

import time

from leanserve import LLM, SamplingParams
from leanserve.loader import default_model_path, load_model

import torch

from benchmarks.common import write_json

TEXTS = ["What is the capital of France? The capital of France is Paris, a city on the Seine.",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
         "The river wound through the valley, past fields of barley and old stone walls. " * 4,
         "In the evening the fishermen pulled their boats onto the gravel and talked about the weather. " * 16]
QUESTION = "Question: Which gas do plants take in from the air to make food?\nAnswer: carbon dioxide"


def reference_logprobs(prompts: list[list[int]]) -> list[torch.Tensor]:
    import os

    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


def main() -> None:
    results = {}
    refs = None
    for quant in ("auto", "none"):
        llm = LLM(loaded=load_model(None, quantization=quant), kv_cache_memory=256 << 20)
        tok = llm.get_tokenizer()
        prompts = [tok.encode(t)[:300] for t in TEXTS]
        refs = refs or reference_logprobs(prompts)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        errs = [abs(o.prompt_logprobs[i][p[i]].logprob - r[i - 1, p[i]].item())
                for o, p, r in zip(outs, prompts, refs, strict=True) for i in range(1, len(p))]
        q = tok.encode(QUESTION)
        batch = [{"prompt_token_ids": q[:len(q) - i % 5]} for i in range(64)]
        times = {}
        for plp in (None, 1):
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                llm.generate(batch, SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=plp),
                             use_tqdm=False)
                runs.append(time.perf_counter() - t0)
            times["with" if plp else "without"] = min(runs)
        results[quant] = {"max_abs_diff": max(errs), "mean_abs_diff": sum(errs) / len(errs), "tokens": len(errs),
                          "batch64_s_without": times["without"], "batch64_s_with": times["with"]}
    print(f"{'weights':8} {'max |diff|':>11} {'mean |diff|':>12} {'64 req, s':>10} {'+prompt lp, s':>14}")
    for quant, r in results.items():
        print(f"{quant:8} {r['max_abs_diff']:11.2e} {r['mean_abs_diff']:12.2e} {r['batch64_s_without']:10.2f} "
              f"{r['batch64_s_with']:14.2f}")
    write_json("benchmarks/results/prompt_logprobs.json", results)


if __name__ == "__main__":
    main()
