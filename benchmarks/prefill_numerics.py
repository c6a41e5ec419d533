"""Log-prob error of each ``--prefill-gemm`` mode against the exact fp32 computation, on the default model.

The reference is the model with the file's weights dequantized to float32 (``--quantization none``: fp32
activations, fp32 GEMMs). Each mode runs the native Q4_1 model (``--quantization auto``) with its prefill rows on
that mode's kernel; every prompt is prefilled in one pass, so every row is a prefill row. Per mode, over all
positions of all prompts: the max and mean absolute error of the next-token log-probabilities over the whole
vocabulary, the same for the log-prob of the token that actually follows, and how often the argmax agrees. Also
the time of each mode's prefill of the prompts (the machine may be shared: see README). The quantized model's
prefill attention is the native kernel the engine pairs with each mode (``--attention native``: bf16 dot products
for ``bf16``, fp32 for ``lane``, ``bf16x3`` and ``int8``) or torch's SDPA (``--attention torch``); the reference
always SDPA. ``bf16`` runs the AVX512_BF16 engine; ``bf16 amx`` (where this process can run AMX tiles) the same
mode with its GEMMs and attention on AMX.

Usage: .venv/bin/python -m benchmarks.prefill_numerics [--lengths 64,128,256,512] [--attention native|torch]
    [--out PATH]
Writes benchmarks/results/prefill_numerics.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import time
from unittest import mock

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops
from leanserve.loader import load_model
from leanserve.model.attention import AttentionMetadata, PrefillChunk
from leanserve.model.llama import LlamaModel
from leanserve.model.prefill_attention import prefill_attention_kernel
from leanserve.quantization.prefill_gemm import BF16_GEMM_ENV, configure_prefill_gemm, prefill_gemm_engine
from leanserve.worker.model_runner import allocate_kv_cache

import torch

from benchmarks.common import corpus_text, write_json

# name -> (--prefill-gemm mode, $LEANSERVE_BF16_GEMM: the bf16 GEMM's and bf16 attention's engine, or None)
MODES = {"lane": ("lane", None), "bf16": ("bf16", "avx512_bf16"), "bf16 amx": ("bf16", "amx"),
         "bf16x3": ("bf16x3", "avx512_bf16"), "int8": ("int8", None)}


@torch.inference_mode()
def prompt_logprobs(model: LlamaModel, ids: list[int], kernel=None) -> tuple[torch.Tensor, float]:
    """Log-softmax of the logits at every position of ``ids`` ([len(ids), vocab] float32), from one prefill pass,
    and the seconds that pass took; ``kernel``: the native prefill attention (None: torch's SDPA)."""
    n = len(ids)
    blocks = -(-n // 16)
    caches = allocate_kv_cache(model, blocks, 16)
    pos = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=pos.clone(), prefills=[PrefillChunk(0, n, 0, torch.arange(blocks))],
                             prefill_kernel=kernel)
    t0 = time.perf_counter()
    hidden = model.forward(torch.tensor(ids), pos, caches, meta)
    seconds = time.perf_counter() - t0
    return torch.log_softmax(model.compute_logits(hidden).double(), dim=-1), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="64,128,256,512", help="prompt lengths (tokens), one prompt each")
    ap.add_argument("--attention", choices=("native", "torch"), default="native",
                    help="prefill attention of the quantized model: the native kernel as the engine runs it "
                         "(leanserve.model.prefill_attention), or torch's SDPA")
    ap.add_argument("--out", default="benchmarks/results/prefill_numerics.json")
    args = ap.parse_args()
    loaded = load_model(None, quantization="auto")
    ids = loaded.tokenizer.encode(corpus_text(200_000), add_special_tokens=False)
    lengths = [int(v) for v in args.lengths.split(",")]
    prompts = [ids[2000 * i:2000 * i + n] for i, n in enumerate(lengths)]
    ref_model = LlamaModel(loaded.config, loaded.weights, quantization="none")
    refs = [prompt_logprobs(ref_model, p)[0] for p in prompts]
    del ref_model
    model = LlamaModel(loaded.config, loaded.weights, quantization="auto")
    results = {}
    ext = native_ops()
    for name, (mode, engine) in MODES.items():
        if engine == "amx" and (ext is None or ext.amx_bf16_status() != "ready"):
            continue  # no AMX tiles in this process
        with mock.patch.dict(os.environ, {BF16_GEMM_ENV: engine} if engine else {}):
            resolved = configure_prefill_gemm(model, mode)
        # the prefill attention the engine pairs with the mode (bf16 dots for bf16, on the bf16 GEMM's engine;
        # fp32 otherwise), or SDPA
        kernel = None if args.attention == "torch" else prefill_attention_kernel(
            ext, loaded.config.head_dim, 16, resolved, prefill_gemm_engine(model))
        prompt_logprobs(model, prompts[0], kernel)  # warm-up
        full_max = full_sum = tok_max = tok_sum = 0.0
        count = tokens = agree = 0
        seconds = 0.0
        for p, ref in zip(prompts, refs, strict=True):
            lp, s = prompt_logprobs(model, p, kernel)
            seconds += s
            d = (lp - ref).abs()
            full_max, full_sum, count = max(full_max, d.max().item()), full_sum + d.sum().item(), count + d.numel()
            nxt = torch.tensor(p[1:])
            dt = d[:-1].gather(1, nxt[:, None])[:, 0]
            tok_max, tok_sum, tokens = max(tok_max, dt.max().item()), tok_sum + dt.sum().item(), tokens + len(dt)
            agree += (lp.argmax(-1) == ref.argmax(-1)).sum().item()
        attention = "torch" if kernel is None else f"bf16 on {kernel.engine}" if kernel.bf16 else "fp32"
        results[name] = {"resolved": resolved, "bf16_gemm_engine": prefill_gemm_engine(model), "attention": attention,
                         "vocab_max_abs": full_max,
                         "vocab_mean_abs": full_sum / count,
                         "next_token_max_abs": tok_max, "next_token_mean_abs": tok_sum / tokens,
                         "argmax_agreement": agree / sum(lengths), "prefill_s": seconds,
                         "prefill_tok_s": sum(lengths) / seconds}
    print(f"prompts of {lengths} tokens; log-prob error vs the dequantized fp32 model (nats)")
    print(f"{'mode':<10}{'vocab max':>11}{'vocab mean':>12}{'next max':>10}{'next mean':>11}{'argmax':>8}{'tok/s':>8}")
    for mode, r in results.items():
        print(f"{mode:<10}{r['vocab_max_abs']:>11.2e}{r['vocab_mean_abs']:>12.2e}{r['next_token_max_abs']:>10.2e}"
              f"{r['next_token_mean_abs']:>11.2e}{r['argmax_agreement']:>8.4f}{r['prefill_tok_s']:>8.0f}")
    write_json(args.out, {"lengths": lengths, "attention": args.attention, "modes": results})


if __name__ == "__main__":
    main()
