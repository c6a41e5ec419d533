"""Attention over the paged KV cache: its share of a decode step, and a prefill chunk's attention per kernel.

Decode: for each context (128, 1,024 and 4,096 tokens) and batch size, times a full decode step of the model and the
30 layers' paged attention calls alone (same metadata, same cache), and reports attention's share, for each KV cache
dtype asked for.

Prefill (``--prefill-keys``): one layer's ``paged_attention`` of a 256-token chunk whose last token is key number
256, 1,024 or 2,048 (the model's 9 query heads on 3 KV heads, head size 64, random fp32 cache in scattered blocks):
torch's SDPA path (gather + mask, as without the kernel) beside the native kernel's fp32 and bf16 paths
(leanserve/kernels/prefill_attention.cpp), fastest of ``--repeats`` after a warm-up.

Decode kernel (``--kernel-batches 1,4,16``): the 30 layers' ``paged_decode_attention`` calls alone, on the model's
shape (9 query heads on 3 KV heads, head size 64, block size 16) over random caches of 30 layers (fp32, or each dtype
of ``--kernel-kv-dtypes float32,float16``) in scattered blocks (a pool twice the tokens read, so long contexts come
from DRAM as in a served model), per batch and context, fastest of ``--repeats``; with ``--baseline-ext PATH.so``
(a kernel build of another source, e.g. from the torch_extensions cache before a change) that build is timed in the
same turns and its outputs compared.

Engine prefill (``--engine-prefill 512,2048``): cold prefill tokens/s of a prompt of each length on the default
engine (native Q4_1, ``--prefill-gemm auto``), the prefill kernel on and off (``runner.prefill_kernel`` set to
None: the SDPA path) in alternation in one process, so a shared machine's load hits both alike; medians of
``--engine-repeats``. Usage:
    .venv/bin/python -m benchmarks.attention [--batches 1,8] [--contexts 128,1024,4096] [--kv-cache-dtypes auto,float16]
        [--prefill-keys 256,1024,2048] [--prefill-only] [--engine-prefill 512,2048 [--engine-repeats 5]]
        [--kernel-batches 1,4,16 [--kernel-contexts 128,512,1024,2048,4096] [--kernel-kv-dtypes float32,float16]
         [--baseline-ext PATH.so]]
Writes benchmarks/results/attention.json (the decode kernel section: attention_decode_kernel.json) and prints
tables.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from leanserve.core.request import Request
from leanserve.core.scheduler import ScheduledRequest
from leanserve.loader import load_model
from leanserve.model.attention import AttentionMetadata, PrefillChunk, paged_attention
from leanserve.model.llama import LlamaModel
from leanserve.sampling_params import SamplingParams
from leanserve.worker.model_runner import ModelRunner, allocate_kv_cache

import torch

from benchmarks.common import load_extension, write_json

BLOCK = 16


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model: LlamaModel, batch: int, context: int, repeats: int, native: bool, kv_dtype: str = "auto") -> dict:
    cfg = model.config
    blocks_per_seq = context // BLOCK + 1
    kv = allocate_kv_cache(model, batch * blocks_per_seq, BLOCK, kv_cache_dtype=kv_dtype)
    runner = ModelRunner(model, kv, BLOCK, sampler=None, use_native_kernels=native)
    scheduled = []
    for b in range(batch):  # sequences whose first `context` tokens are cached; decode token number context+1
        req = Request(str(b), [1] * (context + 1), SamplingParams(max_tokens=1), 1)
        req.num_computed_tokens = context
        table = list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq))
        scheduled.append(ScheduledRequest(req, 1, table))
    ids, pos, meta, idx = runner.build_inputs(scheduled)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=model.dtype)
    k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    v = torch.randn_like(k)

    @torch.inference_mode()
    def step():
        model.compute_logits(model.forward(ids, pos, kv, meta)[idx])

    @torch.inference_mode()
    def attention():
        for k_cache, v_cache in kv:
            paged_attention(q, k, v, k_cache, v_cache, meta)

    t_step = median_time(step, repeats)
    t_attn = median_time(attention, repeats)
    return {"kernel": "native" if runner.decode_kernel else "torch", "kv_cache_dtype": kv_dtype, "batch": batch,
            "context": context,
            "step_ms": 1e3 * t_step, "attention_ms": 1e3 * t_attn,
            "attention_share": t_attn / t_step}


def measure_prefill(keys: int, repeats: int, chunk: int = 256) -> dict:
    """Milliseconds of one layer's prefill attention of a ``chunk``-token chunk ending at key ``keys``, per path."""
    from leanserve.kernels import native_ops
    from leanserve.model.prefill_attention import PrefillAttentionKernel

    heads, kv_heads, head_dim = 9, 3, 64
    g = torch.Generator().manual_seed(keys)
    num_blocks = 2 * keys // BLOCK
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g)
    v_cache = torch.randn_like(k_cache)
    ids = torch.randperm(num_blocks, generator=g)[:keys // BLOCK]  # scattered blocks
    ctx = keys - chunk
    q = torch.randn(chunk, heads, head_dim, generator=g)
    k = torch.randn(chunk, kv_heads, head_dim, generator=g)
    v = torch.randn_like(k)
    slots = torch.tensor([int(ids[p // BLOCK]) * BLOCK + p % BLOCK for p in range(ctx, keys)])
    rows = -(-chunk // 32) * 32
    mask = (torch.arange(keys)[None] <= torch.arange(ctx, ctx + rows)[:, None]) if ctx else None
    ext = native_ops()
    kernels = {"sdpa": None}
    if ext is not None:
        kernels["fp32"] = PrefillAttentionKernel(ext, False)
        if ext.prefill_attention_bf16_simd():
            kernels["bf16"] = PrefillAttentionKernel(ext, True)
    row = {"chunk": chunk, "keys": keys, "threads": torch.get_num_threads()}
    for name, kernel in kernels.items():
        meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, chunk, ctx, ids, mask)],
                                 prefill_kernel=kernel)

        @torch.inference_mode()
        def run(meta=meta):
            paged_attention(q, k, v, k_cache, v_cache, meta)

        run()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        row[f"{name}_ms"] = 1e3 * min(times)
    for name in kernels:
        if name != "sdpa":
            row[f"{name}_speedup"] = row["sdpa_ms"] / row[f"{name}_ms"]
    return row


def decode_kernel(batches: list[int], contexts: list[int], repeats: int, baseline: str = "",
                  kv_dtypes: tuple[str, ...] = ("float32",)) -> list[dict]:
    """Milliseconds of the 30 layers' paged_decode_attention per (KV dtype, batch, context), this build and a
    baseline's."""
    from leanserve.kernels import native_ops

    builds = {"kernel": native_ops()}
    if builds["kernel"] is None:
        raise SystemExit("the native kernels did not build")
    if baseline:
        builds["baseline"] = load_extension(baseline)
    layers, heads, kv_heads, head_dim = 30, 9, 3, 64
    rows = []
    for kv_dtype, batch, context in itertools.product(kv_dtypes, batches, contexts):
        g = torch.Generator().manual_seed(batch * 100_000 + context)
        per_seq = -(-context // BLOCK)
        pool = 2 * batch * per_seq
        dtype = getattr(torch, kv_dtype)
        caches = [(torch.randn(pool, BLOCK, kv_heads, head_dim, generator=g).to(dtype),
                   torch.randn(pool, BLOCK, kv_heads, head_dim, generator=g).to(dtype)) for _ in range(layers)]
        table = torch.randperm(pool, generator=g)[:batch * per_seq].view(batch, per_seq).clone()
        seq_lens = torch.full((batch,), context)
        q = torch.randn(batch, heads, head_dim, generator=g)

        def run(ext, caches=caches, table=table, seq_lens=seq_lens, q=q):
            return [ext.paged_decode_attention(q, k, v, table, seq_lens, head_dim ** -0.5) for k, v in caches]

        outs = {name: run(ext) for name, ext in builds.items()}  # the warm-up
        best = dict.fromkeys(builds, float("inf"))
        for _ in range(repeats):
            for name, ext in builds.items():
                t0 = time.perf_counter()
                run(ext)
                best[name] = min(best[name], time.perf_counter() - t0)
        row = {"kv_dtype": kv_dtype, "batch": batch, "context": context, "threads": torch.get_num_threads(),
               "kernel_ms": 1e3 * best["kernel"]}
        if baseline:
            row["baseline_ms"] = 1e3 * best["baseline"]
            row["speedup"] = best["baseline"] / best["kernel"]
            row["max_abs_diff"] = max((a - b).abs().max().item()
                                      for a, b in zip(outs["kernel"], outs["baseline"], strict=True))
        rows.append(row)
    return rows


def engine_prefill(lengths: list[int], repeats: int) -> dict:
    """Median cold prefill tokens/s per prompt length, the native prefill attention on and off, alternating."""
    from leanserve import LLM

    from benchmarks.common import corpus_text
    from benchmarks.quant import prefill_tok_s

    llm = LLM(kv_cache_memory=256 << 20)
    kernel = llm.engine.runner.prefill_kernel
    ids = llm.engine.tokenizer.encode(corpus_text(200_000), add_special_tokens=False)
    raw: dict = {m: {"kernel": [], "sdpa": []} for m in lengths}
    for _ in range(repeats + 1):  # the first round warms up
        for m in lengths:
            for name, k in (("kernel", kernel), ("sdpa", None)):
                llm.engine.runner.prefill_kernel = k
                raw[m][name].append(prefill_tok_s(llm, ids[:m]))
    llm.engine.runner.prefill_kernel = kernel
    out = {"prefill_gemm": llm.engine.prefill_gemm, "kernel_bf16": bool(kernel and kernel.bf16), "raw": raw}
    for m in lengths:
        a, b = statistics.median(raw[m]["kernel"][1:]), statistics.median(raw[m]["sdpa"][1:])
        out[str(m)] = {"kernel_tok_s": a, "sdpa_tok_s": b, "speedup": a / b}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated: auto (fp32 here), float16, int8")
    ap.add_argument("--prefill-keys", default="256,1024,2048", help="prefill section: keys at the chunk's end")
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode section")
    ap.add_argument("--engine-prefill", default="", help="engine prefill section: prompt lengths (e.g. 512,2048)")
    ap.add_argument("--engine-repeats", type=int, default=5)
    ap.add_argument("--kernel-batches", default="", help="decode kernel section: batch sizes (e.g. 1,4,16)")
    ap.add_argument("--kernel-contexts", default="128,512,1024,2048,4096")
    ap.add_argument("--kernel-kv-dtypes", default="float32", help="decode kernel section: comma-separated float32, "
                    "float16")
    ap.add_argument("--baseline-ext", default="", help="decode kernel section: another build's .so, timed beside")
    ap.add_argument("--out", default="", help="default benchmarks/results/attention.json, "
                    "attention_decode_kernel.json with --kernel-batches")
    args = ap.parse_args()
    args.out = args.out or f"benchmarks/results/attention{'_decode_kernel' if args.kernel_batches else ''}.json"
    if args.kernel_batches:
        kernel = decode_kernel([int(b) for b in args.kernel_batches.split(",")],
                               [int(c) for c in args.kernel_contexts.split(",")], args.repeats, args.baseline_ext,
                               tuple(args.kernel_kv_dtypes.split(",")))
        print(f"\nDecode kernel: 30 layers' paged_decode_attention ({torch.get_num_threads()} threads), fastest ms")
        print(f"{'KV':>8}{'batch':>6}{'context':>9}{'kernel':>9}" + (f"{'baseline':>10}{'x':>7}{'max diff':>10}"
                                                                     if args.baseline_ext else ""))
        for r in kernel:
            ab = f"{r['baseline_ms']:>10.2f}{r['speedup']:>7.2f}{r['max_abs_diff']:>10.1e}" if args.baseline_ext else ""
            print(f"{r['kv_dtype']:>8}{r['batch']:>6}{r['context']:>9}{r['kernel_ms']:>9.2f}{ab}")
        write_json(args.out, {"decode_kernel": kernel, "baseline_ext": args.baseline_ext})
        return
    prefill = [measure_prefill(int(n), 3 * args.repeats) for n in args.prefill_keys.split(",") if n]
    print(f"\nPrefill attention of a 256-token chunk, one layer (9 heads on 3 KV heads, head_dim 64, "
          f"{torch.get_num_threads()} threads), fastest ms")
    print(f"{'keys':>6}{'sdpa':>9}{'fp32':>9}{'x':>7}{'bf16':>9}{'x':>7}")
    for r in prefill:
        print(f"{r['keys']:>6}{r['sdpa_ms']:>9.2f}{r.get('fp32_ms', float('nan')):>9.2f}"
              f"{r.get('fp32_speedup', float('nan')):>7.2f}{r.get('bf16_ms', float('nan')):>9.2f}"
              f"{r.get('bf16_speedup', float('nan')):>7.2f}")
    engine = {}
    if args.engine_prefill:
        lengths = [int(v) for v in args.engine_prefill.split(",")]
        engine = engine_prefill(lengths, args.engine_repeats)
        print(f"\nEngine prefill tok/s (native Q4_1, --prefill-gemm {engine['prefill_gemm']}, "
              f"{torch.get_num_threads()} threads), median of {args.engine_repeats}, alternating")
        print(f"{'tokens':>7}{'kernel':>9}{'sdpa':>9}{'x':>7}")
        for m in lengths:
            r = engine[str(m)]
            print(f"{m:>7}{r['kernel_tok_s']:>9.0f}{r['sdpa_tok_s']:>9.0f}{r['speedup']:>7.2f}")
    if args.prefill_only:
        write_json(args.out, {"prefill": prefill, "engine_prefill": engine})
        return
    loaded = load_model(None)
    model = LlamaModel(loaded.config, loaded.weights)
    rows = [measure(model, int(b), int(c), args.repeats, native, kv_dtype)
            for kv_dtype in args.kv_cache_dtypes.split(",") for native in (True, False)
            for b in args.batches.split(",") for c in args.contexts.split(",")]
    print(f"\nPaged attention's share of a decode step (fp32 model, {torch.get_num_threads()} threads)")
    print(f"{'KV':>8}{'kernel':>8}{'batch':>6}{'context':>9}{'step ms':>10}{'attention ms':>14}{'share':>8}")
    for r in rows:
        print(f"{r['kv_cache_dtype']:>8}{r['kernel']:>8}{r['batch']:>6}{r['context']:>9}{r['step_ms']:>10.1f}"
              f"{r['attention_ms']:>14.1f}{100 * r['attention_share']:>7.0f}%")
    write_json(args.out, {"rows": rows, "prefill": prefill, "engine_prefill": engine})


if __name__ == "__main__":
    main()
