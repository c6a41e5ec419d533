"""Attention's share of a decode step over the paged KV cache, at contexts of 128, 1,024 and 4,096 tokens.

For each context and batch size, times a full decode step of the model and the 30 layers' paged attention calls
alone (same metadata, same cache), and reports attention's share, for each KV cache dtype asked for. Usage:
    .venv/bin/python -m benchmarks.attention [--batches 1,8] [--contexts 128,1024,4096] [--kv-cache-dtypes auto,float16]
Writes benchmarks/results/attention.json and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time

from leanserve.core.request import Request
from leanserve.core.scheduler import ScheduledRequest
from leanserve.loader import load_model
from leanserve.model.attention import paged_attention
from leanserve.model.llama import LlamaModel
from leanserve.sampling_params import SamplingParams
from leanserve.worker.model_runner import ModelRunner, allocate_kv_cache

import torch

from benchmarks.common import write_json

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated: auto (fp32 here), float16, int8")
    ap.add_argument("--out", default="benchmarks/results/attention.json")
    args = ap.parse_args()
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
    write_json(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
