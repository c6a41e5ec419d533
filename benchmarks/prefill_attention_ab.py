"""Two builds of the native kernels, A/B in one process: ``paged_prefill_attention``'s fp32 path on the chunks of a
2,048-token prompt (8 chunks of 256 rows whose contexts are 0, 256, ..., 1,792 keys; the default model's 9 query
heads on 3 KV heads, head size 64, blocks of 16 scattered over a random fp32 cache), calls of the two builds
alternating so that a shared machine's load hits both alike; best of ``--repeats`` per chunk and build.

The old build is a baseline source tree's (e.g. ``git archive <commit> leanserve | tar -x -C /tmp/base``, or another
checkout; built or found by a subprocess, as ``benchmarks.lane_rows`` does), the new one this checkout's, both for
the instruction-set path of ``$LEANSERVE_KERNEL_ISA``. With ``--threads 1`` (the default) a call is timed by its
thread's CPU time (``time.thread_time``), which leaves out the time the thread waited for a core on a busy machine;
the two builds' outputs are compared (max |difference|; both are within the kernel's 1e-5 of float64). Usage:

    LEANSERVE_KERNEL_ISA=avx2 .venv/bin/python -m benchmarks.prefill_attention_ab --baseline /tmp/base
        [--threads 1] [--repeats 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import time

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import kernel_isa, native_ops

import torch

from benchmarks.common import write_json
from benchmarks.lane_rows import baseline_ext

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="source tree of the old build")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    builds = {"old": baseline_ext(args.baseline), "new": native_ops()}
    if builds["new"] is None:
        raise SystemExit("this checkout's native kernels did not build")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    nblocks = -(-args.prompt // BLOCK) + 4
    k_cache = torch.randn(nblocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn(nblocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    ids = torch.randperm(nblocks, generator=g)
    scale = HEAD_DIM ** -0.5
    rows, total = [], {"old": 0.0, "new": 0.0}
    for ctx in range(0, args.prompt, args.chunk):
        q = torch.randn(min(args.chunk, args.prompt - ctx), HEADS, HEAD_DIM, generator=g)
        outs = {k: m.paged_prefill_attention(q, k_cache, v_cache, ids, ctx, scale, False) for k, m in builds.items()}
        best = {"old": float("inf"), "new": float("inf")}
        for _ in range(args.repeats):
            for k, m in builds.items():
                time.sleep(0.001)  # the other build's pool stops spinning
                t = clock()
                m.paged_prefill_attention(q, k_cache, v_cache, ids, ctx, scale, False)
                best[k] = min(best[k], clock() - t)
        for k in total:
            total[k] += best[k]
        diff = (outs["old"] - outs["new"]).abs().max().item()
        rows.append({"context": ctx, "rows": q.shape[0], "old_ms": best["old"] * 1e3, "new_ms": best["new"] * 1e3,
                     "speedup": best["old"] / best["new"], "max_abs_diff": diff})
        print(f"context {ctx:5d}: old {best['old'] * 1e3:8.3f} ms  new {best['new'] * 1e3:8.3f} ms  "
              f"{best['old'] / best['new']:.2f}x  max|diff| {diff:.1e}")
    print(f"{args.prompt}-token prompt, one layer: old {total['old'] * 1e3:.2f} ms  new {total['new'] * 1e3:.2f} ms  "
          f"{total['old'] / total['new']:.2f}x")
    if args.out:
        write_json(args.out, {"isa": kernel_isa(), "baseline": args.baseline, "old": builds["old"].__name__,
                              "new": builds["new"].__name__, "threads": args.threads,
                              "chunks": rows, "total_old_ms": total["old"] * 1e3, "total_new_ms": total["new"] * 1e3,
                              "speedup": total["old"] / total["new"]})


if __name__ == "__main__":
    main()
