"""Float32 decode with and without the native few-row product (``ext.f32_small_gemm``, used by ``FloatWeight`` for
1-8 rows), side by side in one run, on the default model unquantized (``quantization="none"``).

Each repeat runs batch 1 and batch 4 (64 greedy tokens each, EOS ignored) with the kernel on, then off (NumPy's
BLAS gemv for one row, torch's / OpenBLAS's GEMM for more); the best of the repeats is reported. Then the kernel
alone by rows: ``f32_small_gemm`` over the model's own 120 float32 projection matrices in turn (as a forward pass
reads them: from DRAM, not cache) at T = 1..8 rows, best of 5, and each T's time over T = 1's (what verifying
T - 1 drafts costs in the GEMMs against one plain decode row).

Usage:
    .venv/bin/python -m benchmarks.f32_decode [--repeats 3] [--max-tokens 64]
Writes benchmarks/results/f32_decode.json and prints a table.
"""

from __future__ import annotations

import argparse
import time

import leanserve.quantization.weights as weights
from leanserve import LLM, SamplingParams
from leanserve.kernels import native_ops
from leanserve.loader import load_model

import torch

from benchmarks.common import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--out", default="benchmarks/results/f32_decode.json")
    args = ap.parse_args()
    llm = LLM(loaded=load_model(None), quantization="none", kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    limit = weights.SMALL_GEMM_MAX_ROWS
    samples: dict[tuple[bool, int], list[float]] = {}
    try:
        for _ in range(args.repeats):
            for on in (True, False):
                weights.SMALL_GEMM_MAX_ROWS = limit if on else 0
                for b in map(int, args.batches.split(",")):
                    prompts = [f"Tell me about topic {i}." for i in range(b)]
                    t0 = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    samples.setdefault((on, b), []).append(args.max_tokens * b / (time.perf_counter() - t0))
    finally:
        weights.SMALL_GEMM_MAX_ROWS = limit
    rows = []
    print("| batch | kernel on (tok/s) | kernel off (tok/s) | ratio |\n|---|---|---|---|")
    for b in map(int, args.batches.split(",")):
        on, off = max(samples[(True, b)]), max(samples[(False, b)])
        rows.append({"batch": b, "on_tok_s": on, "off_tok_s": off, "ratio": on / off,
                     "on_samples": samples[(True, b)], "off_samples": samples[(False, b)]})
        print(f"| {b} | {on:.1f} | {off:.1f} | {on / off:.2f}x |")
    kernel = kernel_rows(llm)
    print("| rows | kernel ms (120 projections) | x one row |\n|---|---|---|")
    for r in kernel:
        print(f"| {r['rows']} | {r['ms']:.2f} | {r['x_one_row']:.2f}x |")
    write_json(args.out, {"config": vars(args), "rows": rows, "kernel_rows": kernel})


def kernel_rows(llm: LLM, repeats: int = 5) -> list[dict]:
    """``f32_small_gemm`` ms over every float32 projection of ``llm``'s model at 1..8 rows (best of ``repeats``)."""
    model = llm.engine.model
    ws = [getattr(layer, name).weight for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]
    ext = native_ops()
    out = []
    for t in range(1, weights.SMALL_GEMM_MAX_ROWS + 1):
        xs = {k: torch.randn(t, k) for k in {w.shape[1] for w in ws}}
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for w in ws:
                ext.f32_small_gemm(xs[w.shape[1]], w)
            best = min(best, time.perf_counter() - t0)
        out.append({"rows": t, "ms": best * 1000, "x_one_row": best * 1000 / out[0]["ms"] if out else 1.0})
    return out


if __name__ == "__main__":
    main()
