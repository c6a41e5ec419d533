"""Native kernels on each instruction-set path, side by side in one run, "native" (AVX-512 where the CPU has it)
against the forced "avx2" build. Best of interleaved repeats, one thread by default (``--threads``).

* ``lane``: the lane kernel on the default model's projections (qkv, gate_up, down of layer 0, and the Q8_0 output
  matrix) at M = 1, 8, 32 and 256 rows, AVX-512 VNNI's vpdpwssd against vpmaddwd + vpaddd; both give bit-identical
  outputs (checked). Writes benchmarks/results/kernel_isa.json.
* ``attention``: ``paged_decode_attention`` on the default model's shape (9 query heads, 3 KV heads, head size 64,
  blocks of 16) at 1, 8, 32 and 128 sequences of 256-1,024 tokens of context (uniform, seeded), their blocks
  scattered over the cache, float16 and float32 caches; both paths agree within 1e-5 (checked). Writes
  benchmarks/results/kernel_isa_attention.json.

Usage:

    .venv/bin/python -m benchmarks.kernel_isa [--kernels lane,attention] [--threads 1] [--repeats 15]
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
    ap.add_argument("--seqs", default="1,8,32,128", help="attention: sequences per call")
    ap.add_argument("--kernels", default="lane,attention")
    ap.add_argument("--out", default="benchmarks/results/kernel_isa.json")
    ap.add_argument("--attention-out", default="benchmarks/results/kernel_isa_attention.json")
    args = ap.parse_args()
    paths = {isa: build_native_ops(isa) for isa in ("native", "avx2")}
    kernels = args.kernels.split(",")
    if "attention" in kernels:
        attention(paths, args)
    if "lane" in kernels:
        lane(paths, args)


def attention(paths: dict, args: argparse.Namespace) -> None:
    """Times ``paged_decode_attention`` on both paths (see the module docstring) and writes the JSON."""
    block_size, kv_heads, group, dim = 16, 3, 3, 64
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'cache':<9}{'seqs':>5}{'tokens':>8}{'avx2 us':>10}{'native us':>11}{'native vs avx2':>16}")
    for dtype in (torch.float16, torch.float32):
        for n_seq in (int(n) for n in args.seqs.split(",")):
            gen = torch.Generator().manual_seed(n_seq)
            lens = torch.randint(256, 1025, (n_seq,), generator=gen)
            counts = [-(-int(n) // block_size) for n in lens]
            num_blocks = sum(counts) + 1
            k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
            v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
            perm, tables = torch.randperm(num_blocks, generator=gen).tolist(), []
            for c in counts:
                tables.append(perm[:c])
                perm = perm[c:]
            table = torch.tensor([t + [0] * (max(counts) - len(t)) for t in tables])
            q = torch.randn(n_seq, kv_heads * group, dim, generator=gen)
            operands = (q, k_cache, v_cache, table, lens, dim ** -0.5)
            call = {isa: functools.partial(ext.paged_decode_attention, *operands) for isa, ext in paths.items()}
            torch.testing.assert_close(call["native"](), call["avx2"](), atol=1e-5, rtol=1e-5)
            inner = max(1, 256 // n_seq)
            times = {isa: float("inf") for isa in call}
            for _ in range(args.repeats):  # interleaved, so both see the same machine
                for isa, fn in call.items():
                    times[isa] = min(times[isa], best_time(fn, 1, inner))
            tokens = int(lens.sum())
            rows.append({"cache_dtype": str(dtype).removeprefix("torch."), "seqs": n_seq, "tokens": tokens,
                         "avx2_s": times["avx2"], "native_s": times["native"],
                         "speedup": times["avx2"] / times["native"]})
            print(f"{rows[-1]['cache_dtype']:<9}{n_seq:>5}{tokens:>8}{times['avx2'] * 1e6:>10.0f}"
                  f"{times['native'] * 1e6:>11.0f}{times['avx2'] / times['native']:>15.2f}x")
    write_json(args.attention_out, {"threads": args.threads, "shape": {"heads": kv_heads * group, "kv_heads": kv_heads,
               "head_dim": dim, "block_size": block_size}, "rows": rows})


def lane(paths: dict, args: argparse.Namespace) -> None:
    """Times the lane kernel on both paths (see the module docstring) and writes the JSON."""
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
