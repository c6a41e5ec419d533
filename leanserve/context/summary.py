"""The summary of the turns a history budget dropped (``history_summary_tokens``): its request, key and message.

Pure pieces shared by the server (``entrypoints/openai/history_summary.py``, which runs the request through the
engine, once per dropped prefix) and ``LLM.chat``:

- :func:`summary_prompt` (:func:`summary_request_messages`): the internal request that asks the served model to
  summarize the dropped messages (a system instruction, then a user message with the transcript, ``role:
  content`` per line, and the instruction repeated); when the transcript does not fit ``max_prompt_tokens``, its
  oldest messages are left out (the last one cut from its start as a last resort).
- :func:`summary_key`: SHA-256 of the served model, the summary's token budget and the dropped messages exactly
  (JSON with sorted keys): the same dropped prefix has the same key, whatever comes after it.
- :func:`summary_message`: the message put right after the leading system/developer messages: role ``system``,
  its content starting with :data:`SUMMARY_PREFIX`, which marks it as a summary.
- :class:`SummaryCache`: a small LRU of finished summaries, bounded in entries.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

SUMMARY_ROLE = "system"
SUMMARY_PREFIX = "Summary of the earlier conversation (older turns left out to fit the context): "
INSTRUCTION = ("You summarize conversations. Write a short, factual summary of the conversation below in a few "
               "sentences: who asked what, the answers given, names, numbers and decisions. No preamble.")


def summary_key(model: str, max_tokens: int, messages: Sequence[dict[str, Any]], tenant: str | None = None) -> str:
    """Hex SHA-256 of (tenant, served model, summary token budget, the dropped messages exactly): a tenant never
    meets, or learns of, another tenant's conversations."""
    blob = json.dumps([tenant, model, max_tokens, list(messages)], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def summary_message(text: str) -> dict[str, Any]:
    """The summary as a chat message (role :data:`SUMMARY_ROLE`, content marked by :data:`SUMMARY_PREFIX`)."""
    return {"role": SUMMARY_ROLE, "content": SUMMARY_PREFIX + text}


def with_summary(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with the summary inserted right after its leading system/developer messages."""
    k = 0
    while k < len(messages) and messages[k].get("role") in ("system", "developer"):
        k += 1
    return messages[:k] + [summary_message(text)] + messages[k:]


def _line(m: dict[str, Any]) -> str:
    content = m.get("content")
    if isinstance(content, list):  # text parts
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = f"{m.get('role', 'user')}: {content or ''}"
    calls = m.get("tool_calls") or []
    if calls:
        text += " [tool calls: " + "; ".join(f"{c['function']['name']}({_arguments_text(c['function'])})"
                                             for c in calls) + "]"
    return text


def _arguments_text(fn: dict[str, Any]) -> str:
    """A call's arguments as JSON text (OpenAI's form as given; an object, Hugging Face's form, serialized)."""
    args = fn.get("arguments", "")
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def summary_request_messages(messages: Sequence[dict[str, Any]], start: int = 0) -> list[dict[str, Any]]:
    """The chat of the summarization request of ``messages[start:]`` (before the chat template)."""
    body = "\n".join(_line(m) for m in messages[start:])
    return _request(body)


def _request(body: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": "Conversation:\n" + body + "\n\nSummarize this conversation."}]


def summary_prompt(messages: Sequence[dict[str, Any]], tokenizer: Any, max_prompt_tokens: int) -> list[int]:
    """Token ids of the summarization request of ``messages`` (chat template applied, encoded without added
    special tokens, as the server encodes a chat), at most ``max_prompt_tokens`` long when that is possible.

    The oldest lines left out are found by a binary search over the cut point: at most ceil(log2(n)) + 3 renders
    (template + encode) of the transcript for n messages, so a long conversation costs O(n log n), not O(n^2).

    Raises:
        ValueError: ``messages`` is empty.
    """
    if not messages:
        raise ValueError("nothing to summarize")
    lines = [_line(m) for m in messages]

    def render(body: str) -> list[int]:
        text = tokenizer.apply_chat_template(_request(body), add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    ids = render("\n".join(lines))
    if len(ids) > max_prompt_tokens and len(lines) > 1:
        # the fewest oldest lines left out so that the rest fits: a binary search over the cut point (the token
        # count does not grow as lines are left out), ceil(log2(n)) renders, not one per line
        lo, hi, best = 1, len(lines) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            cand = render("\n".join(lines[mid:]))
            if len(cand) <= max_prompt_tokens:
                best, hi = (mid, cand), mid - 1
            else:
                lo = mid + 1
        ids = best[1] if best is not None else render(lines[-1])
    if len(ids) > max_prompt_tokens:  # one message alone is too long: keep its end
        last = tokenizer.encode(lines[-1], add_special_tokens=False)
        keep = max(1, len(last) - (len(ids) - max_prompt_tokens))
        ids = render(tokenizer.decode(last[-keep:]))
    return ids


class SummaryCache:
    """Finished summaries by :func:`summary_key`, least recently used evicted beyond ``max_entries``."""

    def __init__(self, max_entries: int = 256) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        text = self._entries.get(key)
        if text is not None:
            self._entries.move_to_end(key)
        return text

    def put(self, key: str, text: str) -> None:
        self._entries[key] = text
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
