"""Command-line options of ``leanserve eval`` (kept apart so ``leanserve --help`` does not import torch)."""

from __future__ import annotations

import argparse


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """Add the ``eval`` options to ``p``."""
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--configs", default="none,int8,int4",
                   help="comma-separated: none, auto, int8, int4, kv-int8, kv-float16, or joined with '+' "
                        "(int4+kv-int8); "
                        "the first is the baseline")
    p.add_argument("--text", default=None, help="text file for perplexity (default: the bundled public-domain text)")
    p.add_argument("--ppl-tokens", type=int, default=1024, help="tokens of the text to score")
    p.add_argument("--ppl-window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--tests", default=None, help="JSONL test set (default: the bundled example)")
    p.add_argument("--max-tokens", type=int, default=64, help="generation limit per test case")
    p.add_argument("--agreement-prompts", type=int, default=20,
                   help="prompts (windows of the text) for greedy agreement with the baseline")
    p.add_argument("--speed", action="store_true", help="also measure decode tokens/s at batch 1 and 32")
    p.add_argument("--max-drop", type=float, default=None,
                   help="exit 1 when a config's test-set accuracy is more than this below the baseline's")
    p.add_argument("--json-out", default=None, help="write the results as JSON here")
    p.add_argument("--png-out", default=None, help="write a bar chart here (needs matplotlib)")
