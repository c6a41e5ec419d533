"""How long one huge chat request's context policies take to prepare (the work the server does in a worker
thread, off the event loop), on the default model's tokenizer.

A fresh-user trial's request: 2,400 turns (~300 KB of JSON; the conversation of
``tests/entrypoints/test_context_server.py``) under ``max_prompt_tokens=1000`` with ``history_summary_tokens=16``:
``prepare_chat`` (passages none, the history trimmed twice: plain and with the summary's room) and
``summary_prompt`` of the dropped messages (the summarization request, cut to the model's context by a binary
search over its first kept line). Best of three runs each.

Usage:
    .venv/bin/python -m benchmarks.context_prepare
Writes benchmarks/results/context_prepare.json and prints the times.
"""

from __future__ import annotations

import json
import time

from leanserve.context.chat import prepare_chat
from leanserve.context.summary import summary_prompt
from leanserve.loader import default_model_path
from leanserve.loader.gguf_tensors import open_gguf
from leanserve.tokenizer import Tokenizer

from benchmarks.common import write_json
from benchmarks.history_summary import conversation


def best_of(n: int, fn) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    tok = Tokenizer.from_gguf(open_gguf(default_model_path()))
    conv = conversation(1201)  # 2,400 messages after the system prompt
    t_prep, prepared = best_of(3, lambda: prepare_chat(conv, tok, max_prompt_tokens=1000, history_summary_tokens=16))
    limit = 8192 - 16
    t_sum, ids = best_of(3, lambda: summary_prompt(prepared.summary_messages, tok, limit))
    result = {"messages": len(conv), "request_bytes": len(json.dumps(conv)), "prepare_chat_s": round(t_prep, 3),
              "summary_prompt_s": round(t_sum, 3), "summarized_messages": len(prepared.summary_messages),
              "summary_prompt_tokens": len(ids), "prompt_tokens": len(prepared.prompt_token_ids)}
    print(json.dumps(result, indent=2))
    write_json("benchmarks/results/context_prepare.json", result)


if __name__ == "__main__":
    main()
