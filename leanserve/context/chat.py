"""One chat request's context policies, in order: passages (``documents``), then history, then the template.

:func:`prepare_chat` is what the server (``entrypoints/openai/context_policies.py``) and ``LLM.chat`` both run.
The history budget counts the passages too: they sit in the latest user turn, which is never dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from leanserve.context.history import count_tokens, trim_history
from leanserve.context.passages import as_passages, build_messages, last_user_text, select_passages


@dataclass
class PreparedChat:
    """The prompt of a chat after its policies, and what they did.

    Attributes:
        prompt_token_ids: the rendered prompt, encoded without added special tokens (as the server encodes it).
        messages: the messages sent to the template (passages written in, old turns dropped).
        prompt_tokens_sent: tokens of the conversation as given (all passages included), before any policy.
        dropped_messages: indexes into the given messages (None: no history policy).
        documents_used / documents_dropped / documents_duplicates: passage ids (None: no documents); the
            duplicates map a removed id to the kept one it repeats.
    """

    prompt_token_ids: list[int]
    messages: list[dict[str, Any]]
    prompt_tokens_sent: int
    dropped_messages: list[int] | None = None
    documents_used: list[str] | None = None
    documents_dropped: list[str] | None = None
    documents_duplicates: dict[str, str] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.dropped_messages is not None or self.documents_used is not None


class _WithKwargs:
    """A tokenizer whose template always gets ``kwargs`` (a template that renders ``documents`` itself)."""

    def __init__(self, tokenizer: Any, kwargs: dict[str, Any]) -> None:
        self._tok, self._kwargs = tokenizer, kwargs

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        return self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **self._kwargs, **kw)

    def encode(self, text, add_special_tokens=True):
        return self._tok.encode(text, add_special_tokens=add_special_tokens)


def prepare_chat(messages: Sequence[dict[str, Any]], tokenizer: Any, *, documents: Sequence[Any] | None = None,
                 max_context_tokens: int | None = None, top_k_documents: int | None = None,
                 reorder_documents: bool = True, max_prompt_tokens: int | None = None,
                 keep_last_turns: int | None = None, add_generation_prompt: bool = True) -> PreparedChat:
    """Apply the passage policy (:func:`~leanserve.context.passages.select_passages`, query = the last user
    message), then the history policy (:func:`~leanserve.context.history.trim_history`), then the chat template.

    Raises:
        InvalidParameterError: bad documents or budgets, a template error; ContextLengthExceededError: the
            pinned part of the conversation exceeds ``max_prompt_tokens``.
    """
    msgs = [dict(m) for m in messages]
    kwargs: dict[str, Any] = {}
    out = PreparedChat([], msgs, 0)
    sent = None
    if documents is not None:
        sel = select_passages(last_user_text(msgs), documents, tokenizer, max_context_tokens=max_context_tokens,
                              top_k=top_k_documents, reorder=reorder_documents)
        all_msgs, all_kwargs = build_messages(msgs, as_passages(documents), tokenizer)
        sent = count_tokens(tokenizer, all_msgs, add_generation_prompt, **all_kwargs)
        msgs, kwargs = build_messages(msgs, sel.used, tokenizer)
        out.documents_used, out.documents_dropped, out.documents_duplicates = sel.used_ids, sel.dropped, \
            sel.duplicates
    if max_prompt_tokens is not None or keep_last_turns is not None:
        tok = _WithKwargs(tokenizer, kwargs) if kwargs else tokenizer
        trimmed = trim_history(msgs, tok, max_prompt_tokens=max_prompt_tokens, keep_last_turns=keep_last_turns,
                               add_generation_prompt=add_generation_prompt)
        out.dropped_messages = trimmed.dropped
        sent = trimmed.num_tokens_sent if sent is None else sent
        msgs = trimmed.messages
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
    out.prompt_token_ids = tokenizer.encode(text, add_special_tokens=False)
    out.messages = msgs
    out.prompt_tokens_sent = len(out.prompt_token_ids) if sent is None else sent
    return out
