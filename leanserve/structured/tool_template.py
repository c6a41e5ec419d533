"""A tokenizer view whose chat template renders ``tools`` and tool turns, for the server and ``LLM.chat`` alike.

A template that uses ``tools`` gets them, and the messages with each tool call's ``arguments`` as an object
(Hugging Face chat templates write ``arguments | tojson``; OpenAI sends JSON text, which would be encoded twice);
any other template (SmolLM2's) gets the
conversation through the hermes fallback (:func:`leanserve.structured.tools.render_messages`): assistant
``tool_calls`` written back as ``<tool_call>`` blocks (an OpenAI assistant message may have ``content: None``
beside its ``tool_calls``), ``role: "tool"`` results as a user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from leanserve.structured.tools import render_messages


def has_tool_turns(messages: Sequence[Any]) -> bool:
    """Whether a conversation (dicts) has a tool result or an assistant message with ``tool_calls``."""
    return any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages)


class ToolTemplate:
    """``tokenizer`` with a chat template that renders ``tools`` and tool turns (module docstring); every other
    attribute is the tokenizer's."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
        self._tok, self._tools = tokenizer, tools

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        if "tools" in (getattr(self._tok, "chat_template", None) or ""):
            return self._tok.apply_chat_template([_arguments_as_objects(m) for m in messages],
                                                 add_generation_prompt=add_generation_prompt, tools=self._tools, **kw)
        return self._tok.apply_chat_template(render_messages(list(messages), self._tools),
                                             add_generation_prompt=add_generation_prompt, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def _arguments_as_objects(message: Any) -> Any:
    """``message`` (not changed) with each tool call's ``arguments`` JSON text parsed into an object; arguments
    that are already an object, or not valid JSON, stay as they are."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls:
        return message

    def parsed(call: Any) -> Any:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if not isinstance(args, str):
            return call
        try:
            value = json.loads(args)
        except ValueError:
            return call
        return {**call, "function": {**fn, "arguments": value}}

    return {**message, "tool_calls": [parsed(c) for c in calls]}
