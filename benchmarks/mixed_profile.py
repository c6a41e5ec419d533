"""Where the mixed workload's time goes, per kernel instruction-set path: ``benchmarks.throughput``'s "mixed"
workload (``--requests`` of its 128 requests, prompts 50-1,000 tokens, outputs 20-500, float16 KV cache, up to 128
sequences per step, 2,048 batched tokens, the KV pool made resident first as benchmarks.throughput does) run by the
engine under cProfile, once in a subprocess per ``$LEANSERVE_KERNEL_ISA`` ("avx2": the AVX2 build of the native
kernels, "native": AVX-512 where the CPU has it). Reports the run's seconds, the top functions by own time
(``paged_decode_attention`` among them: the steps with a prefill chunk) and the fused decode's phases (its native
clock: the decode-only steps, one ``DecodeLayers.forward`` call each). Usage:

    .venv/bin/python -m benchmarks.mixed_profile [--requests 32] [--threads 1] [--isas avx2,native]

Writes benchmarks/results/mixed_profile.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.common import write_json

_CHILD = r"""
import cProfile, json, pstats, sys, time
import leanserve  # noqa: F401  (first: OpenMP wait policy)
import torch
from benchmarks.common import make_workload
from benchmarks.throughput import WORKLOADS, run_leanserve
from leanserve import LLM
from leanserve.loader import load_model
requests, threads, top = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
loaded = load_model(None, quantization="auto")
n, prompt_range, output_range = WORKLOADS["mixed"]
reqs = make_workload(loaded.tokenizer, requests, prompt_range, output_range, seed=0)
llm = LLM(loaded=loaded, kv_cache_memory=1 << 30, max_num_seqs=128, max_num_batched_tokens=2048,
          quantization="auto", kv_cache_dtype="float16", kv_cache_prefault=True)
fused = llm.engine.runner.model.fused_decode
if fused is not None:
    fused.set_profiling(True)
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
res = run_leanserve(llm, reqs)
prof.disable()
wall = time.perf_counter() - t0
stats = pstats.Stats(prof).stats
rows = sorted(({"function": f"{k[0].rsplit('/', 1)[-1]}:{k[1]}({k[2]})", "calls": v[1], "tottime_s": v[2]}
               for k, v in stats.items()), key=lambda r: -r["tottime_s"])
phases = fused.profile() if fused is not None else {}
print("RESULT " + json.dumps({"wall_s": wall, "output_tokens": res.get("output_tokens"), "top": rows[:top],
                             "fused_decode_phases_s": phases}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isas", default="avx2,native")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results/mixed_profile.json")
    args = ap.parse_args()
    runs = {}
    for isa in args.isas.split(","):
        env = dict(os.environ, LEANSERVE_KERNEL_ISA=isa)
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(args.requests), str(args.threads), str(args.top)],
                              env=env, capture_output=True, text=True, check=True)
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        runs[isa] = json.loads(line.removeprefix("RESULT "))
        attn = next((r for r in runs[isa]["top"] if "paged_decode_attention" in r["function"]), None)
        print(f"{isa}: {runs[isa]['wall_s']:.1f} s under cProfile, paged_decode_attention "
              + (f"{attn['tottime_s']:.1f} s in {attn['calls']} calls" if attn else "not in the top functions"))
        for r in runs[isa]["top"]:
            print(f"  {r['tottime_s']:8.2f} s {r['calls']:>8}  {r['function']}")
        phases = dict(runs[isa]["fused_decode_phases_s"])
        if phases:
            print(f"  fused decode, {phases.pop('forwards'):.0f} steps:")
            for name, sec in sorted(phases.items(), key=lambda kv: -kv[1]):
                print(f"  {sec:8.2f} s  {name}")
    write_json(args.out, {"requests": args.requests, "threads": args.threads, "runs": runs})


if __name__ == "__main__":
    main()
