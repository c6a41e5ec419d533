"""Offline throughput: leanserve's continuous batching vs transformers' static batches vs llama.cpp's server.

Workloads (fixed seed, real text from the Python standard library's sources):
  (a) mixed: 128 requests, prompts 50-1,000 tokens, outputs 20-500 tokens;
  (b) kb:    64 knowledge-base-style requests, prompts 1,500-2,500 tokens, outputs 100-200 tokens.
Every request generates exactly its output length (EOS ignored) in every engine. leanserve runs up to 128
sequences per step with a float16 KV cache (llama.cpp's default KV type), its pool made resident before the clock
starts (``--kv-cache-prefault``), as llama-server writes its KV buffer when it starts (on a VM the first write of
fresh memory can cost seconds per GiB, which either engine pays once); llama-server runs 16 parallel slots, its
fastest setting here (workload (a) at half size: 62.7 output tok/s with 16 slots, 57.0 with 64).

Usage:
    .venv/bin/python -m benchmarks.throughput [--workloads mixed,kb] [--hf-requests 16] [--llama-server PATH]
transformers is slow, so it runs the first --hf-requests requests of each workload (its rate is comparable).
Writes benchmarks/results/throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import time
from pathlib import Path

from leanserve import LLM, SamplingParams
from leanserve.loader import load_model

import httpx
import torch

from benchmarks.common import BenchRequest, LlamaServer, find_llama_server, make_workload, peer_environ, write_json

WORKLOADS = {"mixed": (128, (50, 1000), (20, 500)), "kb": (64, (1500, 2500), (100, 200))}


def run_leanserve(llm: LLM, reqs: list[BenchRequest]) -> dict:
    engine = llm.engine
    bs = engine.config.block_size
    for i, r in enumerate(reqs):
        engine.add_request(f"b{i}", r.prompt_ids, SamplingParams(temperature=0, max_tokens=r.max_tokens,
                                                                  ignore_eos=True))
    peak_blocks = peak_tokens = peak_running = 0
    out_tokens = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
        running = engine.scheduler.running
        used = engine.kv.num_blocks - engine.kv.pool.num_free_blocks
        if used > peak_blocks:
            peak_blocks, peak_tokens = used, sum(r.num_computed_tokens for r in running)
        peak_running = max(peak_running, len(running))
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    per_token = engine.kv_bytes_per_token
    return {
        "elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + prompt_tokens) / elapsed, "preemptions": engine.get_stats().num_preemptions,
        "peak_running": peak_running,
        "kv_used_bytes_at_peak": peak_blocks * bs * per_token,
        "kv_slots_filled_at_peak_bytes": peak_tokens * per_token,
        "kv_waste_pct": 100.0 * (1 - peak_tokens / (peak_blocks * bs)) if peak_blocks else 0.0,
        "kv_contiguous_reservation_bytes": peak_running * engine.max_model_len * per_token,
    }


def run_transformers(model_path: str, reqs: list[BenchRequest], batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    useful = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(reqs), batch):
            group = reqs[i:i + batch]
            width = max(len(r.prompt_ids) for r in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for j, r in enumerate(group):  # left padding
                ids[j, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                mask[j, width - len(r.prompt_ids):] = 1
            n = max(r.max_tokens for r in group)  # a static batch runs until its longest request is done
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=0)
            useful += sum(r.max_tokens for r in group)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    return {"elapsed_s": elapsed, "output_tokens": useful, "output_tok_s": useful / elapsed,
            "total_tok_s": (useful + prompt_tokens) / elapsed, "requests": len(reqs), "batch": batch}


def run_llama_server(binary: str, model_path: str, reqs: list[BenchRequest], slots: int, threads: int) -> dict:
    ctx = max(len(r.prompt_ids) + r.max_tokens for r in reqs) + 16
    with LlamaServer(binary, model_path, slots, ctx, threads) as srv:
        def one(r: BenchRequest) -> int:
            body = {"prompt": r.prompt_ids, "n_predict": r.max_tokens, "ignore_eos": True, "temperature": 0,
                    "cache_prompt": False}
            resp = httpx.post(srv.url + "/completion", json=body, timeout=3600)
            resp.raise_for_status()
            return int(resp.json()["tokens_predicted"])
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(slots) as pool:
            out_tokens = sum(pool.map(one, reqs))
        elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    return {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed,
            "total_tok_s": (out_tokens + prompt_tokens) / elapsed, "slots": slots}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--workloads", default="mixed,kb")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's requests to run")
    ap.add_argument("--hf-requests", type=int, default=16, help="requests given to transformers (0 = skip)")
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server (default: see README)")
    ap.add_argument("--llama-slots", type=int, default=16)
    ap.add_argument("--kv-cache-memory", type=int, default=4 << 30)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--quantization", default="auto", help="leanserve's weights (default: auto, as it serves)")
    ap.add_argument("--kv-cache-dtype", default="float16",
                    help="leanserve's KV cache (default float16: llama.cpp's default KV type, so both read as many "
                         "bytes per token of context)")
    ap.add_argument("--no-kv-cache-prefault", dest="kv_cache_prefault", action="store_false",
                    help="leave leanserve's KV pool to fault in during the run")
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    args = ap.parse_args()

    loaded = load_model(args.model, quantization=args.quantization)
    binary = find_llama_server(args.llama_server)
    threads = torch.get_num_threads()
    results: dict[str, dict] = {}
    for name in args.workloads.split(","):
        n, prompt_range, output_range = WORKLOADS[name]
        reqs = make_workload(loaded.tokenizer, max(1, int(n * args.scale)), prompt_range, output_range, seed=0)
        res = {}
        llm = LLM(loaded=loaded, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, kv_cache_prefault=args.kv_cache_prefault)
        res["leanserve"] = run_leanserve(llm, reqs)
        del llm
        if binary:
            res["llama.cpp"] = run_llama_server(binary, loaded.path, reqs, args.llama_slots, threads)
        else:
            res["llama.cpp"] = {"skipped": "llama-server not found: build it as benchmarks/README.md says"}
        if args.hf_requests:
            # in a fresh process: transformers ran up to 40% slower in a process where leanserve had run
            with peer_environ(), mp.get_context("spawn").Pool(1) as pool:
                res["transformers"] = pool.apply(run_transformers,
                                                 (str(loaded.path), reqs[: args.hf_requests], args.hf_batch))
        results[name] = res
        print(f"\nworkload {name}: {len(reqs)} requests, prompts {prompt_range}, outputs {output_range}, "
              f"{threads} threads")
        print(f"{'engine':<14}{'output tok/s':>14}{'total tok/s':>13}{'x leanserve':>13}")
        base = res["leanserve"]["output_tok_s"]
        for engine, r in res.items():
            if "skipped" in r:
                print(f"{engine:<14}{'skipped':>14}")
                continue
            print(f"{engine:<14}{r['output_tok_s']:>14.1f}{r['total_tok_s']:>13.1f}{r['output_tok_s'] / base:>12.2f}x")
        ls = res["leanserve"]
        print(f"KV at peak: {ls['kv_used_bytes_at_peak'] / 2**20:.0f} MiB in blocks, waste {ls['kv_waste_pct']:.2f}% "
              f"(contiguous reservation to max_model_len: {ls['kv_contiguous_reservation_bytes'] / 2**20:.0f} MiB); "
              f"peak running {ls['peak_running']}, preemptions {ls['preemptions']}")
    write_json(args.out, {"threads": threads, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                          "kv_cache_prefault": args.kv_cache_prefault, "max_num_seqs": args.max_num_seqs,
                          "results": results})


if __name__ == "__main__":
    main()
