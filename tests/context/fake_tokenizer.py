"""A tokenizer whose token counts can be worked out by hand: the "template" writes one line per message,
``role: content [call:NAME ...]``, plus ``assistant:`` as the generation prompt; a token is a whitespace-separated
word."""

from __future__ import annotations


class WordTokenizer:
    chat_template = "(fake)"

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        lines = []
        for m in messages:
            calls = " ".join(f"call:{c['function']['name']}" for c in m.get("tool_calls") or [])
            lines.append(f"{m['role']}: {m.get('content') or ''} {calls}".rstrip())
        if add_generation_prompt:
            lines.append("assistant:")
        return "\n".join(lines)

    def encode(self, text, add_special_tokens=True):
        return list(range(len(text.split())))
