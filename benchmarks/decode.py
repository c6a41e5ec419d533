"""Single-stream decode and prefill speed: leanserve (fp32, bf16, and the default native 4-bit weights) beside
transformers' generate (fp32).

Same model file, same prompts, same run (transformers in a fresh subprocess); results as ratios. Usage:
    .venv/bin/python -m benchmarks.decode [--decode-tokens 128] [--prefill-tokens 512] [--repeats 3]
Writes benchmarks/results/decode.json and prints a table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path

from leanserve import LLM, SamplingParams
from leanserve.loader import load_model

import torch

from benchmarks.common import peer_environ, write_json

TEXT = ("The river wound through the valley, past fields of barley and old stone walls. In the evening the "
        "fishermen pulled their boats onto the gravel and talked about the weather and the new bridge. ")


def leanserve_run(llm: LLM, prompt_ids: list[int], long_ids: list[int], n: int, repeats: int) -> dict:
    decode, prefill = [], []
    llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    for _ in range(repeats):
        out = llm.generate({"prompt_token_ids": prompt_ids},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        decode.append(out.metrics.decode_tokens_per_s)
        llm.engine.kv.pool.reset_prefix_cache()  # measure a cold prefill
        out = llm.generate({"prompt_token_ids": long_ids}, SamplingParams(temperature=0, max_tokens=1),
                           use_tqdm=False)[0]
        prefill.append(len(long_ids) / out.metrics.prefill_time)
    return {"decode_tok_s": statistics.median(decode), "prefill_tok_s": statistics.median(prefill)}


def transformers_run(prompt_ids: list[int], long_ids: list[int], n: int, repeats: int, model_path: str) -> dict:
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    decode, prefill = [], []
    with torch.no_grad():
        x = torch.tensor([prompt_ids])
        model.generate(x, do_sample=False, max_new_tokens=4, pad_token_id=0)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(x, do_sample=False, max_new_tokens=1, pad_token_id=0)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(x, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
            total = time.perf_counter() - t0
            decode.append((n - 1) / (total - first))
            y = torch.tensor([long_ids])
            t0 = time.perf_counter()
            model.generate(y, do_sample=False, max_new_tokens=1, pad_token_id=0)
            prefill.append(len(long_ids) / (time.perf_counter() - t0))
    return {"decode_tok_s": statistics.median(decode), "prefill_tok_s": statistics.median(prefill),
            "load_s": load_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()

    loaded = load_model(args.model)
    tok = loaded.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}]),
                            add_special_tokens=False)
    long_ids = tok.encode(TEXT * 40)[: args.prefill_tokens]
    results: dict[str, dict] = {}
    quantized = load_model(args.model, quantization="auto")  # a GGUF file's native 4/8-bit weights, as served
    for name, weights, dtype in (("float32", loaded, "float32"), ("bfloat16", loaded, "bfloat16"),
                                 ("auto (native 4-bit)", quantized, "float32")):
        llm = LLM(loaded=weights, dtype=dtype, kv_cache_memory=256 << 20)
        results[f"leanserve {name}"] = leanserve_run(llm, prompt_ids, long_ids, args.decode_tokens, args.repeats)
        results[f"leanserve {name}"]["load_s"] = weights.load_time_s
        del llm
    if not args.skip_transformers:
        # in a fresh process: after leanserve ran here, transformers measured up to 40% slower in this process
        with peer_environ(), mp.get_context("spawn").Pool(1) as pool:
            results["transformers float32"] = pool.apply(
                transformers_run, (prompt_ids, long_ids, args.decode_tokens, args.repeats, str(loaded.path)))
    base = results.get("transformers float32")
    print(f"\nSingle stream, {args.decode_tokens} decode tokens, {len(long_ids)}-token prefill, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'engine':<32}{'decode tok/s':>14}{'prefill tok/s':>15}{'decode x HF':>13}{'prefill x HF':>14}")
    for name, r in results.items():
        rd = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        rp = f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x" if base else "-"
        print(f"{name:<32}{r['decode_tok_s']:>14.1f}{r['prefill_tok_s']:>15.1f}{rd:>13}{rp:>14}")
    write_json(args.out, {"config": vars(args), "threads": torch.get_num_threads(), "results": results})


if __name__ == "__main__":
    main()
