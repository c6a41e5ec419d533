"""Float32 decode with and without the native few-row product (``ext.f32_small_gemm``, used by ``FloatWeight`` for
1-8 rows), side by side in one run, on the default model unquantized (``quantization="none"``).

Each repeat runs batch 1 and batch 4 (64 greedy tokens each, EOS ignored) with the kernel on, then off (NumPy's
BLAS gemv for one row, torch's / OpenBLAS's GEMM for more); the best of the repeats is reported.

Usage:
    .venv/bin/python -m benchmarks.f32_decode [--repeats 3] [--max-tokens 64]
Writes benchmarks/results/f32_decode.json and prints a table.
"""

from __future__ import annotations

import argparse
import time

import leanserve.quantization.weights as weights
from leanserve import LLM, SamplingParams
from leanserve.loader import load_model

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
    write_json(args.out, {"config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
