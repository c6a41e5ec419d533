"""Where a long prefill's time goes: cold prefills of one ``--tokens``-token prompt (distinct token ids each run, so
no prefix-cache hit) on the default model, each native call and projection timed around itself: the GEMMs per
projection (``LinearWeight.matmul``, whatever ``--prefill-gemm`` chose), the prefill attention kernel and the rest
of ``paged_attention`` (KV write, dispatch), the fused add+RMSNorm, RoPE and SwiGLU, the embedding, the logits;
"other" is the forward pass's remainder (torch ops and Python between the calls). The KV pool is cycled once
before the timed runs, so the figures are of a warm engine (a never-touched part of a pool pays its first-touch
page faults once: see the README's "Memory of the hot paths"). Usage:

    .venv/bin/python -m benchmarks.prefill_profile [--tokens 2048] [--repeats 3] [--threads 2]
        [--prefill-gemm auto]

``LEANSERVE_KERNEL_ISA=avx2`` profiles the AVX2 path. Writes benchmarks/results/prefill_profile.json (``--out``)
and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import leanserve  # noqa: F401  (first: OpenMP wait policy)
import leanserve.model.attention as attention_module
import leanserve.model.llama as llama_module
from leanserve import LLM, SamplingParams
from leanserve.loader import load_model

import torch

from benchmarks.common import write_json
from benchmarks.step_profile import Clock, TimedExt

KV_MEMORY = 256 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-gemm", default="auto")
    ap.add_argument("--out", default="benchmarks/results/prefill_profile.json")
    args = ap.parse_args()
    llm = LLM(loaded=load_model(None, quantization="auto"), kv_cache_memory=KV_MEMORY, num_threads=args.threads,
              prefill_gemm=args.prefill_gemm)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1)
    runs = itertools.count()

    def prefill() -> float:
        run = next(runs)
        ids = [(i * 7919 + run * 104729) % 40000 + 100 for i in range(args.tokens)]
        t = time.perf_counter()
        engine.add_request(f"p{run}", ids, params)
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    capacity = engine.kv.num_tokens_capacity()
    for _ in range(max(2, -(-capacity // args.tokens) + 1)):  # warm-up: every block of the pool touched once
        prefill()
    plain = statistics.median(prefill() for _ in range(args.repeats))

    clock = Clock()
    runner, model = engine.runner, engine.runner.model
    if runner.prefill_kernel is not None:
        runner.prefill_kernel = clock.wrap("prefill attention kernel", runner.prefill_kernel)
    for layer in model.layers:
        for kind in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, kind)
            w.matmul = clock.wrap(f"gemm {kind}", w.matmul)
    llama_module.paged_attention = clock.wrap("paged_attention", llama_module.paged_attention)
    attention_module.write_kv = clock.wrap("KV write", attention_module.write_kv)
    if model._fused is not None:
        model._fused = TimedExt(model._fused, clock, "fused")
    model.embed_tokens = clock.wrap("embedding", model.embed_tokens)
    model.compute_logits = clock.wrap("logits", model.compute_logits)
    model.forward = clock.wrap("forward", model.forward)
    wrapped = statistics.median(prefill() for _ in range(args.repeats))  # the wrappers stay: the process ends
    per = {name: s / args.repeats for name, s in clock.seconds.items()}
    calls = {name: c / args.repeats for name, c in clock.calls.items()}
    kernel = per.get("prefill attention kernel", 0.0)
    rows = [(k, per[k], calls[k]) for k in sorted(per) if k.startswith("gemm ")]
    rows.append(("prefill attention kernel", kernel, calls.get("prefill attention kernel", 0)))
    rows.append(("paged_attention beside the kernel (KV write incl.)", per["paged_attention"] - kernel,
                 calls["paged_attention"]))
    rows.append(("  of which KV write", per.get("KV write", 0.0), calls.get("KV write", 0)))
    rows += [(k, per[k], calls[k]) for k in sorted(per) if k.startswith("fused.")]
    rows.append(("embedding", per["embedding"], calls["embedding"]))
    accounted = sum(s for k, s, _ in rows if not k.startswith("  "))  # the KV write is inside paged_attention
    rows.append(("other (torch ops, Python between calls)", per["forward"] - accounted, 0))
    rows.append(("forward (all of the above)", per["forward"], calls["forward"]))
    rows.append(("logits", per["logits"], calls["logits"]))
    print(f"prefill of {args.tokens} tokens, {torch.get_num_threads()} threads, prefill GEMM {engine.prefill_gemm}: "
          f"median {plain:.3f} s plain ({args.tokens / plain:.0f} tok/s), {wrapped:.3f} s wrapped")
    print(f"{'part':<52}{'ms':>9}{'share':>8}{'calls':>8}")
    for name, s, c in rows:
        print(f"{name:<52}{s * 1e3:>9.1f}{s / per['forward']:>8.1%}{c:>8.0f}")
    write_json(args.out, {"tokens": args.tokens, "threads": torch.get_num_threads(), "repeats": args.repeats,
                          "prefill_gemm": engine.prefill_gemm, "plain_s": plain, "wrapped_s": wrapped,
                          "parts": [{"part": n.strip(), "s": s, "calls": c} for n, s, c in rows]})


if __name__ == "__main__":
    main()
