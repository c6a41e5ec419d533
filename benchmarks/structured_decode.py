"""Decode speed with grammar masks (structured outputs) vs without, at batch 1 and 32, on the default model.

Each configuration generates exactly ``--tokens`` tokens per sequence (greedy) from short chat prompts: plain
(``ignore_eos``), a JSON schema whose array needs more items than fit (so the grammar never lets it end), and an
EBNF grammar of capitalized words that may end only after a NUL byte. Output tokens / wall time of the whole
``generate`` call, median of ``--repeats`` (the configurations interleaved), and the cost of the masks relative
to plain. Usage:
    .venv/bin/python -m benchmarks.structured_decode [--tokens 96] [--repeats 3] [--batch 1 32]
Writes benchmarks/results/structured_decode.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from leanserve import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"]}, "minItems": 1000}
GRAMMAR = 'root ::= ([A-Z] [a-z]+ " ")+ "\\x00"'  # capitalized words; it may end only after a NUL byte
TOPICS = ["rivers", "birds", "cities", "trees", "planets", "metals", "rivers in Asia", "old ships"]


def configs(tokens: int) -> dict[str, SamplingParams]:
    return {
        "plain": SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
        "json_schema": SamplingParams(temperature=0, max_tokens=tokens,
                                      structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        "grammar": SamplingParams(temperature=0, max_tokens=tokens,
                                  structured_outputs=StructuredOutputsParams(grammar=GRAMMAR)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--out", default="benchmarks/results/structured_decode.json")
    args = ap.parse_args()
    llm = LLM(max_num_seqs=max(args.batch), kv_cache_memory=512 << 20, max_model_len=1024)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"List {TOPICS[i % len(TOPICS)]} with a number each ({i})."}]), False)}
        for i in range(max(args.batch))]
    results: dict[str, dict[str, float]] = {}
    for batch in args.batch:
        rates: dict[str, list[float]] = {name: [] for name in configs(args.tokens)}
        for params in configs(args.tokens).values():
            llm.generate(prompts[:batch], params, use_tqdm=False)  # warm-up (and the grammar compiled once)
        for _ in range(args.repeats):  # configurations interleaved: a change in the machine's load hits all alike
            for name, params in configs(args.tokens).items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:batch], params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                assert n == batch * args.tokens, (name, n)
                rates[name].append(n / elapsed)
        results[str(batch)] = {name: statistics.median(r) for name, r in rates.items()}
    print(f"output tokens/s, {args.tokens} tokens per sequence, median of {args.repeats}")
    print(f"{'batch':>5} {'plain':>9} {'json_schema':>18} {'grammar':>18}")
    for batch, row in results.items():
        cells = [f"{row[k]:>9.1f} ({100 * (row['plain'] / row[k] - 1):+5.1f}%)" for k in ("json_schema", "grammar")]
        print(f"{batch:>5} {row['plain']:>9.1f} {cells[0]:>18} {cells[1]:>18}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tokens": args.tokens, "tok_s": results}, indent=2))


if __name__ == "__main__":
    main()
