"""The summary of dropped chat turns (``history_summary_tokens``): what it costs on the first turn that drops
history, what it saves afterwards (reused, the prefix cache still hitting), on the default model.

A 40-turn conversation (the one of ``tests/entrypoints/test_context_server.py``) under ``max_prompt_tokens=1024``,
answered for two consecutive turns (the second adds the first's answer and a new question), with plain dropping
and with ``history_summary_tokens=32``, through ``LLM.chat`` (the server runs the same ``prepare_chat``). Per turn:
wall time, prompt tokens, prompt tokens from the prefix cache, and the summary's status. Each setting runs on a
fresh engine (an empty prefix cache), greedy, 16 output tokens.

Usage:
    .venv/bin/python -m benchmarks.history_summary
Writes benchmarks/results/history_summary.json and prints a table.
"""

from __future__ import annotations

import time

from leanserve import LLM, SamplingParams
from leanserve.loader import load_model

from benchmarks.common import write_json


def conversation(turns: int) -> list[dict]:
    conv = [{"role": "system", "content": "You are a patient travel agent. Answer in one short sentence."}]
    for i in range(turns):
        conv.append({"role": "user", "content": f"Question {i}: what is a good thing to see in city number {i}, "
                     "and how long should I stay there if I like museums and parks?"})
        if i < turns - 1:
            conv.append({"role": "assistant", "content": f"In city {i}, visit the old town and its museum; two "
                         "days are enough for the museums and one more for the parks."})
    return conv


def run(loaded, summary_tokens: int | None) -> list[dict]:
    llm = LLM(loaded=loaded, kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=16)
    conv, rows = conversation(40), []
    for turn in range(2):
        t0 = time.perf_counter()
        out = llm.chat(conv, params, use_tqdm=False, max_prompt_tokens=1024, history_summary_tokens=summary_tokens)
        dt = time.perf_counter() - t0
        ctx = llm.last_chat_context[0]
        rows.append({"turn": turn + 1, "seconds": round(dt, 3), "prompt_tokens": len(out[0].prompt_token_ids),
                     "cached_tokens": out[0].num_cached_tokens, "dropped": len(ctx.dropped_messages or []),
                     "summary": ctx.summary_status})
        conv = conv + [{"role": "assistant", "content": out[0].outputs[0].text},
                       {"role": "user", "content": "Thanks! And what about the food there?"}]
    return rows


def main() -> None:
    loaded = load_model(None, quantization="auto")
    result = {"plain": run(loaded, None), "summary_32": run(loaded, 32)}
    write_json("benchmarks/results/history_summary.json", result)
    print(f"{'setting':<12}{'turn':>5}{'s':>8}{'prompt':>8}{'cached':>8}{'dropped':>8}  summary")
    for name, rows in result.items():
        for r in rows:
            print(f"{name:<12}{r['turn']:>5}{r['seconds']:>8.2f}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}"
                  f"{r['dropped']:>8}  {r['summary']}")


if __name__ == "__main__":
    main()
