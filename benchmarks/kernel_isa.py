"""The lane kernel on each instruction-set path, side by side in one run: the default model's projections (qkv,
gate_up, down of layer 0, and the Q8_0 output matrix) at M = 1, 8, 32 and 256 rows, "native" (AVX-512 VNNI's
vpdpwssd where the CPU has it) against the forced "avx2" path (vpmaddwd + vpaddd). Both give bit-identical
outputs (checked). Best of interleaved repeats, one thread by default (``--threads``). Usage:

    .venv/bin/python -m benchmarks.kernel_isa [--threads 1] [--repeats 15]

Writes benchmarks/results/kernel_isa.json and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import time

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve import LLM
from leanserve.kernels import build_native_ops
from leanserve.loader import load_model

import torch

from benchmarks.common import write_json


def best_time(fn, repeats: int, inner: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--out", default="benchmarks/results/kernel_isa.json")
    args = ap.parse_args()
    paths = {isa: build_native_ops(isa) for isa in ("native", "avx2")}
    model = LLM(loaded=load_model(None, quantization="auto"), kv_cache_memory=16 << 20).engine.runner.model
    layer = model.layers[0]
    weights = {"qkv": layer.qkv, "gate_up": layer.gate_up, "down": layer.down, "lm_head": model.lm_head}
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'weight':<9}{'M':>5}{'avx2 us':>10}{'native us':>11}{'native vs avx2':>16}")
    for name, w in weights.items():
        k = w.codes.shape[1] * 32
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            operands = (x, w.codes, w.d, w._mn(), w.bits)
            call = {isa: functools.partial(ext.lane_quant_gemm, *operands) for isa, ext in paths.items()}
            assert torch.equal(call["native"](), call["avx2"]()), "the paths must give bit-identical outputs"
            times = {isa: float("inf") for isa in call}
            for _ in range(args.repeats):  # interleaved, so both see the same machine
                for isa, fn in call.items():
                    times[isa] = min(times[isa], best_time(fn, 1))
            rows.append({"weight": name, "m": m, "k": k, "avx2_s": times["avx2"], "native_s": times["native"],
                         "speedup": times["avx2"] / times["native"]})
            print(f"{name:<9}{m:>5}{times['avx2'] * 1e6:>10.0f}{times['native'] * 1e6:>11.0f}"
                  f"{times['avx2'] / times['native']:>15.2f}x")
    write_json(args.out, {"threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
