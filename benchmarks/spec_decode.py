"""Speculative decoding (n-gram prompt lookup) on and off, side by side in one run, on the default model.

Workloads (greedy, fixed seed, offline text from the Python standard library, PSF License):
  extract     copy a docstring's first paragraph and list the names it mentions (output repeats the input);
  quote-qa    answer a question about three retrieved passages by quoting them;
  code-edit   rename a function and return its whole code;
  copywriting short marketing copy from a brief (little to copy: speculation should stay out of the way);
  mixed       benchmarks.throughput's mixed workload (prompts 50-1,000, outputs 20-500 tokens, EOS ignored).
Each input-grounded workload runs at batch 1 (requests one after the other), 8 and 32 (all at once); mixed runs 32
requests at once. Both engines share the loaded weights; the prefix cache is reset before every run, and greedy
outputs are checked token-identical (so both runs produce the same tokens). Reported: output tok/s of each, their
ratio, acceptance rate (accepted / verified drafts) and mean acceptance length (1 + accepted / verifications).

Peer: where llama.cpp's ``llama-server`` is built (``../shared/tools/build-llama-cpp.sh``, or ``--llama-server``), the
same input-grounded chat requests at batch 1 go to it on the same GGUF file and threads, without speculation and
with its prompt-lookup drafting (``--spec-type ngram-simple``: its defaults, lookup n-gram 12 and drafts up to 48
tokens, and one matched to ours, n-gram 4 and 4 drafts); its responses' ``timings`` give draft and accepted counts.

The fp32 rows (``--draft-workloads``): the same file dequantized as the unquantized target, with and without its
own 4-bit weights as the draft model (``--draft-num-speculative-tokens``, 8 by default; the draft reads the
target's KV cache unless ``--draft-own-cache``), batch 1.

Usage:
    .venv/bin/python -m benchmarks.spec_decode [--num-speculative-tokens 4] [--max-tokens 160] [--no-adaptive]
Writes benchmarks/results/spec_decode.json and prints a table.
"""

from __future__ import annotations

import argparse
import inspect
import random
import time

from leanserve import LLM, SamplingParams
from leanserve.bench.corpus import docstring_passages
from leanserve.loader import load_model

import httpx
import torch

from benchmarks.common import LlamaServer, find_llama_server, make_workload, write_json

BRIEFS = ["a reusable steel water bottle", "a quiet mechanical keyboard", "a weekend cooking class",
          "a solar phone charger", "a language-learning app", "a standing desk", "a bike repair kit",
          "a noise-cancelling headset"]


def _functions(n: int, rng: random.Random) -> list[str]:
    import collections
    import json
    import textwrap

    found = [textwrap.dedent(inspect.getsource(obj)) for mod in (textwrap, json, collections)
             for _, obj in inspect.getmembers(mod, inspect.isfunction) if obj.__module__.startswith(mod.__name__)]
    found = [f for f in found if 400 <= len(f) <= 2400]
    rng.shuffle(found)
    return [found[i % len(found)] for i in range(n)]


def conversations(name: str, n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` chat requests of one workload."""
    rng = random.Random(seed)
    passages = [p for p in docstring_passages(min_chars=400, max_total_chars=200_000) if len(p.text) < 2500]
    convs = []
    for i in range(n):
        if name == "extract":
            p = rng.choice(passages)
            convs.append([{"role": "user", "content": f"{p.text}\n\nCopy the first paragraph of the text above "
                                                      "word for word, then list the names it mentions."}])
        elif name == "quote-qa":
            docs = rng.sample(passages, 3)
            body = "\n\n".join(f"[{j + 1}] {d.source}: {d.text[:700]}" for j, d in enumerate(docs))
            convs.append([{"role": "user", "content": f"{body}\n\nQuoting the documents above, what does "
                                                      f"{docs[0].source} do? Cite the document number."}])
        elif name == "code-edit":
            code = _functions(n, rng)[i]
            convs.append([{"role": "user", "content": f"```python\n{code}```\nRename the function to `renamed` "
                                                      "and return the whole updated function."}])
        elif name == "copywriting":
            convs.append([{"role": "user", "content": f"Write a short, upbeat product description of "
                                                      f"{BRIEFS[i % len(BRIEFS)]} for a shop website."}])
        else:
            raise ValueError(name)
    return convs


def run(llm: LLM, prompts: list, params: SamplingParams, batch: int) -> tuple[float, list[list[int]], dict]:
    """Output tok/s of ``prompts`` in groups of ``batch`` (each group one continuous batch), the token ids, and
    the speculative-decoding counters of the run."""
    engine = llm.engine
    engine.kv.pool.reset_prefix_cache()
    before = engine.get_stats()
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        outs += llm.generate(group, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = engine.get_stats()
    tokens = [o.outputs[0].token_ids for o in outs]
    spec = {"drafts": after.spec_num_drafts - before.spec_num_drafts,
            "draft_tokens": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            "accepted": after.spec_num_accepted_tokens - before.spec_num_accepted_tokens}
    return sum(map(len, tokens)) / elapsed, tokens, spec


LLAMA_CPP_VARIANTS = {
    "off": [],
    "ngram-simple (n 12, m 48)": ["--spec-type", "ngram-simple"],
    "ngram-simple (n 4, m 4)": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                                "--spec-ngram-simple-size-m", "4", "--spec-draft-n-max", "4"],
}


def llama_cpp_rows(binary: str, model: str, workloads: list[str], max_tokens: int, threads: int) -> list[dict]:
    """Output tok/s of llama-server on each input-grounded workload at batch 1 (4 requests one after the other,
    greedy, prompt cache off), per variant of :data:`LLAMA_CPP_VARIANTS`, with its draft / accepted counts."""
    rows = []
    for variant, extra in LLAMA_CPP_VARIANTS.items():
        with LlamaServer(binary, model, slots=1, ctx_per_slot=4096, threads=threads, extra_args=extra) as srv, \
                httpx.Client(base_url=srv.url, timeout=600) as client:
            for name in workloads:
                tokens = drafts = accepted = 0
                t0 = time.perf_counter()
                for conv in conversations(name, 4):
                    r = client.post("/v1/chat/completions", json={
                        "messages": conv, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": False})
                    r.raise_for_status()
                    body = r.json()
                    tokens += body["usage"]["completion_tokens"]
                    timings = body.get("timings", {})
                    drafts += timings.get("draft_n", 0)
                    accepted += timings.get("draft_n_accepted", 0)
                elapsed = time.perf_counter() - t0
                rows.append({"engine": "llama.cpp", "variant": variant, "workload": name, "batch": 1,
                             "output_tokens": tokens, "tok_s": tokens / elapsed, "draft_tokens": drafts,
                             "accepted": accepted, "acceptance_rate": accepted / drafts if drafts else None})
                print(f"llama.cpp {variant:<26} {name:<12} batch  1: {tokens / elapsed:7.1f} tok/s  "
                      f"drafted {drafts}  accepted {accepted}", flush=True)
    off = {r["workload"]: r["tok_s"] for r in rows if r["variant"] == "off"}
    for r in rows:
        r["ratio_to_off"] = r["tok_s"] / off[r["workload"]]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--draft-num-speculative-tokens", type=int, default=8,
                    help="the fp32 target's 4-bit self-draft rows (it agrees with the target almost always)")
    ap.add_argument("--draft-own-cache", action="store_true",
                    help="the self-draft keeps a KV cache of its own (share_kv_cache false)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--no-adaptive", action="store_true", help="verify every draft (no cost model)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--workloads", default="extract,quote-qa,code-edit,copywriting,mixed")
    ap.add_argument("--draft-workloads", default="extract,copywriting",
                    help="workloads of the fp32 target with its own 4-bit draft, at batch 1 ('' to skip)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: the built peer, if any)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp peer")
    ap.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = ap.parse_args()
    loaded = load_model(args.model, quantization="auto")
    tok = loaded.tokenizer
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "adaptive": not args.no_adaptive}
    kw = {"kv_cache_memory": 1 << 30, "max_num_seqs": 32}
    base = LLM(loaded=loaded, **kw)
    spec = LLM(loaded=loaded, speculative_config=spec_cfg, **kw)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in filter(None, args.workloads.split(",")):
        if name == "mixed":
            reqs = make_workload(tok, 32, (50, 1000), (20, 500), seed=0)
            cases = [(32, [{"prompt_token_ids": r.prompt_ids} for r in reqs],
                      [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs])]
        else:
            cases = []
            for b in batches:
                convs = conversations(name, max(b, 4))
                prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c), add_special_tokens=False)}
                           for c in convs]
                cases.append((b, prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens)))
        for b, prompts, params in cases:
            off, want, _ = run(base, prompts, params, b)
            on, got, counts = run(spec, prompts, params, b)
            row = {"workload": name, "batch": b, "requests": len(prompts), "output_tokens": sum(map(len, want)),
                   "off_tok_s": off, "on_tok_s": on, "ratio": on / off, "same_tokens": got == want, **counts,
                   "acceptance_rate": counts["accepted"] / counts["draft_tokens"] if counts["draft_tokens"] else None,
                   "mean_acceptance_length": 1 + counts["accepted"] / counts["drafts"] if counts["drafts"] else None}
            rows.append(row)
            acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
            mal = "-" if row["mean_acceptance_length"] is None else f"{row['mean_acceptance_length']:.2f}"
            print(f"{name:<12} batch {b:>2}: off {off:7.1f} tok/s  on {on:7.1f} tok/s  {on / off:5.2f}x  "
                  f"acceptance {acc}  mean length {mal}  same tokens {row['same_tokens']}", flush=True)
    if args.draft_workloads:
        fp32 = load_model(args.model)  # the same file dequantized: the unquantized target
        draft_cfg = {"method": "draft_model", "quantization": "auto",
                     "num_speculative_tokens": args.draft_num_speculative_tokens, "adaptive": not args.no_adaptive,
                     "share_kv_cache": False if args.draft_own_cache else None}
        base32 = LLM(loaded=fp32, quantization="none", kv_cache_memory=512 << 20)
        spec32 = LLM(loaded=fp32, quantization="none", kv_cache_memory=512 << 20, speculative_config=draft_cfg)
        for name in args.draft_workloads.split(","):
            prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c), add_special_tokens=False)}
                       for c in conversations(name, 4)]
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
            off, want, _ = run(base32, prompts, params, 1)
            on, got, counts = run(spec32, prompts, params, 1)
            row = {"workload": f"{name} (fp32 + 4-bit self-draft)", "batch": 1, "requests": len(prompts),
                   "output_tokens": sum(map(len, want)), "off_tok_s": off, "on_tok_s": on, "ratio": on / off,
                   "same_tokens": got == want, **counts,
                   "acceptance_rate": counts["accepted"] / counts["draft_tokens"] if counts["draft_tokens"] else None,
                   "mean_acceptance_length": 1 + counts["accepted"] / counts["drafts"] if counts["drafts"] else None}
            rows.append(row)
            print(f"{row['workload']:<38} batch 1: off {off:6.1f} tok/s  on {on:6.1f} tok/s  {on / off:5.2f}x  "
                  f"acceptance {row['acceptance_rate'] or 0:.2f}  mean length {row['mean_acceptance_length'] or 0:.2f}"
                  f"  same tokens {row['same_tokens']}", flush=True)
    peer_rows = []
    binary = None if args.no_llama_cpp else find_llama_server(args.llama_server)
    if binary:
        grounded_names = [w for w in args.workloads.split(",") if w in ("extract", "quote-qa", "code-edit")]
        peer_rows = llama_cpp_rows(binary, loaded.path, grounded_names, args.max_tokens, torch.get_num_threads())
        ours = {r["workload"]: r for r in rows if r["batch"] == 1}
        for p in peer_rows:
            if p["workload"] in ours:
                p["leanserve_ngram_tok_s"] = ours[p["workload"]]["on_tok_s"]
                p["leanserve_ngram_vs_this"] = ours[p["workload"]]["on_tok_s"] / p["tok_s"]
    grounded = [r for r in rows if r["batch"] == 1 and r["workload"] in ("extract", "quote-qa", "code-edit")]
    summary = {"best_grounded_batch1": max((r["ratio"] for r in grounded), default=None),
               "mean_grounded_batch1": sum(r["ratio"] for r in grounded) / len(grounded) if grounded else None,
               "mixed_32": next((r["ratio"] for r in rows if r["workload"] == "mixed"), None),
               "fp32_self_draft_batch1": [r["ratio"] for r in rows if "self-draft" in r["workload"]],
               "cost_model_ms": None if spec.engine.spec_policy.cost is None else {
                   r: round(s * 1000, 3) for r, s in zip(spec.engine.spec_policy.cost.rows,
                                                         spec.engine.spec_policy.cost.seconds, strict=True)}}
    print(summary)
    write_json(args.out, {"config": vars(args), "threads": torch.get_num_threads(), "rows": rows,
                          "llama_cpp": peer_rows, "summary": summary})


if __name__ == "__main__":
    main()
