"""Gemma 3 270M (Q4_K_M GGUF) single-stream decode and prefill: leanserve (quantization auto: Q8_0 embedding /
output head and Q5_0 -> exact 8-bit on the native block kernels, Q4_K / Q6_K dequantized to fp32 at load; and
quantization none: everything fp32) beside transformers' generate (fp32, fresh subprocess).

Usage (needs `make gemma`):
    .venv/bin/python -m benchmarks.gemma [--decode-tokens 64] [--prefill-tokens 512] [--repeats 3]
Writes benchmarks/results/gemma.json and prints a table. Gemma is a base model: the prompt is plain text.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from pathlib import Path

from leanserve import LLM
from leanserve.loader import load_model

import torch

from benchmarks.common import peer_environ
from benchmarks.decode import TEXT, leanserve_run, transformers_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/gemma.json")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    results: dict[str, dict] = {}
    path = None
    for quantization in ("auto", "none"):
        loaded = load_model("gemma3-270m", quantization=quantization)
        path = loaded.path
        tok = loaded.tokenizer
        prompt_ids = tok.encode("Once upon a time, in a small village by the sea,")
        long_ids = tok.encode(TEXT * 40)[: args.prefill_tokens]
        llm = LLM(loaded=loaded, kv_cache_memory=256 << 20, max_model_len=4096)
        r = leanserve_run(llm, prompt_ids, long_ids, args.decode_tokens, args.repeats)
        r["weight_mb"] = llm.engine.model.weight_bytes() / 1e6
        results[f"leanserve {quantization}"] = r
        del llm, loaded
    if not args.skip_transformers:
        with peer_environ(), mp.get_context("spawn").Pool(1) as pool:
            results["transformers float32"] = pool.apply(
                transformers_run, (prompt_ids, long_ids, args.decode_tokens, args.repeats, path))
    base = results.get("transformers float32")
    print(f"\nGemma 3 270M, single stream, {args.decode_tokens} decode tokens, {len(long_ids)}-token prefill, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'engine':<24}{'decode tok/s':>14}{'prefill tok/s':>15}{'decode x HF':>13}{'weights MB':>12}")
    for name, r in results.items():
        rd = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        print(f"{name:<24}{r['decode_tok_s']:>14.1f}{r['prefill_tok_s']:>15.1f}{rd:>13}"
              f"{r.get('weight_mb', float('nan')):>12.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "threads": torch.get_num_threads(), "results": results},
                              indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
