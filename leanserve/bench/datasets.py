"""Benchmark requests read from a file: ShareGPT-style conversations (JSON list or JSONL), or JSONL lines of
``{"prompt": TEXT, "max_tokens": N}``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from leanserve.bench.workloads import BenchRequest
from leanserve.tokenizer import Tokenizer

MIN_TOKENS = 4  # ShareGPT turns shorter than this (prompt or reply) are skipped, as vLLM does


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a file: a JSON list, or one object per non-empty line (JSONL)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from exc
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = json.loads(stripped)
    else:
        data = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    data.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
    if not all(isinstance(d, dict) for d in data):
        raise ValueError(f"{path}: every record must be a JSON object")
    return data


def _turn_text(turn: dict[str, Any]) -> str:
    return str(turn.get("value", turn.get("content", "")))


def load_dataset(path: str | Path, tokenizer: Tokenizer, num_prompts: int, seed: int | None = 0) -> list[BenchRequest]:
    """Up to ``num_prompts`` requests from ``path``, shuffled with ``seed`` (the file order when ``seed`` is None).

    ShareGPT records (``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``; ``role`` /
    ``content`` keys also work) give the first turn as the prompt and the token count of the second turn as
    ``max_tokens``; records with fewer than two turns or a turn under 4 tokens are skipped. Prompt records
    (``{"prompt": str, "max_tokens": int >= 1}``) are taken as they are. Errors name records by their number in the
    file (1-based), whatever the shuffle.

    Raises:
        ValueError: a line is not JSON, a record is neither form or has a bad field, or no usable record is found.
        OSError: the file cannot be read.
    """
    path = Path(path)
    records = list(enumerate(_records(path), 1))
    if seed is not None:
        random.Random(seed).shuffle(records)
    out: list[BenchRequest] = []
    for i, rec in records:
        if len(out) >= num_prompts:
            break
        if "prompt" in rec:
            max_tokens = rec.get("max_tokens")
            if not isinstance(rec["prompt"], str) or not isinstance(max_tokens, int) or isinstance(max_tokens, bool) \
                    or max_tokens < 1:
                raise ValueError(f"{path}: record {i}: needs a string 'prompt' and an integer 'max_tokens' >= 1")
            prompt = rec["prompt"]
        elif "conversations" in rec or "messages" in rec:
            turns = rec.get("conversations", rec.get("messages")) or []
            if len(turns) < 2:
                continue
            prompt = _turn_text(turns[0])
            max_tokens = len(tokenizer.encode(_turn_text(turns[1]), add_special_tokens=False))
            if max_tokens < MIN_TOKENS or len(tokenizer.encode(prompt, add_special_tokens=False)) < MIN_TOKENS:
                continue
        else:
            raise ValueError(f"{path}: record {i} has neither 'prompt' nor 'conversations'")
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out.append(BenchRequest([{"role": "user", "content": prompt}], prompt, prompt_len, max_tokens))
    if not out:
        raise ValueError(f"{path}: no usable request")
    return out
