"""One chat request's context policies, in order: passages (``documents``), then history, then the template.

:func:`prepare_chat` is what the server (``entrypoints/openai/context_policies.py``) and ``LLM.chat`` both run.
The history budget counts the passages too: they sit in the latest user turn, which is never dropped; with
``max_prompt_tokens`` the passages kept are the best-ranked ones that fit it beside the system/developer messages
and the latest user turn (the others are reported in ``documents_dropped``).

With ``history_summary_tokens=N`` (and turns dropped by the budget), the dropped turns are replaced by a summary
(:mod:`leanserve.context.summary`) that the caller gets from the served model: the summary's room is reserved in
``max_prompt_tokens`` (N tokens plus its message's own), so the history is trimmed to ``max_prompt_tokens`` minus
that room; the summary's source is then those dropped messages. :func:`prepare_chat` is pure: a first call without
``summary`` reports ``summary_status="pending"`` and the messages to summarize (its prompt is plain dropping, the
fallback); a second call with the summary's text puts it in (status ``"applied"``), unless the prompt with it is
over ``max_prompt_tokens`` (``"skipped"``, plain dropping). Both calls make the same cut: the cut depends only on
the conversation and the budgets, never on the summary's text, so it stays put across turns as without a summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from leanserve.context.history import TrimmedHistory, count_tokens, for_template, split_turns, trim_history
from leanserve.context.passages import (
    as_passages,
    build_messages,
    last_user_text,
    lost_in_the_middle,
    select_passages,
)
from leanserve.context.summary import summary_message, with_summary
from leanserve.errors import ContextLengthExceededError, InvalidParameterError


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
        summary_status: None (no summary asked, or nothing dropped); "pending" (wanted: summarize
            ``summary_messages`` and call again with the text); "applied" (which callers report as "computed" or
            "reused"); "failed" (set by a caller whose summary request failed); "skipped" (``summary_reason`` says why:
            it cannot fit ``max_prompt_tokens``). ``summary_source``: the indexes of the messages it replaces.
    """

    prompt_token_ids: list[int]
    messages: list[dict[str, Any]]
    prompt_tokens_sent: int
    dropped_messages: list[int] | None = None
    documents_used: list[str] | None = None
    documents_dropped: list[str] | None = None
    documents_duplicates: dict[str, str] = field(default_factory=dict)
    summary_status: str | None = None
    summary_source: list[int] | None = None
    summary_messages: list[dict[str, Any]] | None = None
    summary_reason: str | None = None

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
                 keep_last_turns: int | None = None, add_generation_prompt: bool = True,
                 history_summary_tokens: int | None = None, summary: str | None = None) -> PreparedChat:
    """Apply the passage policy (:func:`~leanserve.context.passages.select_passages`, query = the last user
    message), then the history policy (:func:`~leanserve.context.history.trim_history`), with the summary of the
    dropped turns when ``history_summary_tokens`` is set (module docstring), then the chat template.

    Raises:
        InvalidParameterError: bad documents or budgets (``history_summary_tokens`` < 0), a template error;
            ContextLengthExceededError: the pinned part of the conversation exceeds ``max_prompt_tokens``.
    """
    n = history_summary_tokens
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise InvalidParameterError("history_summary_tokens", f"history_summary_tokens must be an integer >= 0, "
                                    f"got {n!r}")
    msgs = [dict(m) for m in messages]
    kwargs: dict[str, Any] = {}
    out = PreparedChat([], msgs, 0)
    sent = None
    if documents is not None:
        sel = select_passages(last_user_text(msgs), documents, tokenizer, max_context_tokens=max_context_tokens,
                              top_k=top_k_documents, reorder=reorder_documents)
        all_msgs, all_kwargs = build_messages(msgs, as_passages(documents), tokenizer)
        sent = count_tokens(tokenizer, all_msgs, add_generation_prompt, **all_kwargs)
        used, dropped = sel.used, list(sel.dropped)
        if max_prompt_tokens is not None and used:
            order = {p.id: i for i, p in enumerate(as_passages(documents))}
            used, over = _fit_passages(msgs, sel, order, tokenizer, max_prompt_tokens, add_generation_prompt,
                                       reorder_documents)
            dropped += over
        msgs, kwargs = build_messages(msgs, used, tokenizer)
        out.documents_used, out.documents_dropped, out.documents_duplicates = [p.id for p in used], dropped, \
            sel.duplicates
    if max_prompt_tokens is not None or keep_last_turns is not None:
        tok = _WithKwargs(tokenizer, kwargs) if kwargs else tokenizer
        try:
            trimmed = trim_history(msgs, tok, max_prompt_tokens=max_prompt_tokens, keep_last_turns=keep_last_turns,
                                   add_generation_prompt=add_generation_prompt)
        except ContextLengthExceededError as exc:
            if not documents:
                raise
            raise ContextLengthExceededError(
                f"{exc} with {len(out.documents_used or [])} of the documents kept and "
                f"{len(out.documents_dropped or [])} left out to fit", param="max_prompt_tokens") from None
        sent = trimmed.num_tokens_sent if sent is None else sent
        if history_summary_tokens and trimmed.dropped:
            trimmed, msgs_with_summary = _summarize(out, msgs, tok, trimmed, history_summary_tokens, summary,
                                                    max_prompt_tokens, keep_last_turns, add_generation_prompt)
        else:
            msgs_with_summary = None
        out.dropped_messages = trimmed.dropped
        msgs = msgs_with_summary or trimmed.messages
    text = tokenizer.apply_chat_template(for_template(msgs), add_generation_prompt=add_generation_prompt, **kwargs)
    out.prompt_token_ids = tokenizer.encode(text, add_special_tokens=False)
    out.messages = msgs
    out.prompt_tokens_sent = len(out.prompt_token_ids) if sent is None else sent
    return out


def _fit_passages(msgs: list[dict[str, Any]], sel: Any, order: dict[str, int], tokenizer: Any, max_prompt_tokens: int,
                  add_generation_prompt: bool, reorder: bool) -> tuple[list[Any], list[str]]:
    """(the passages kept, the ids left out, best-ranked first) so that the pinned part of the prompt (the
    system/developer messages and the latest user turn, the passages in it) fits ``max_prompt_tokens``: the
    best-ranked passages that fit (the most of them, by a binary search over how many: the pinned part's tokens
    do not shrink as passages are added)."""
    ranked = sorted(sel.used, key=lambda p: (-sel.scores.get(p.id, 0.0), order[p.id]))  # ties: request order
    pinned, _, latest = split_turns(msgs)
    base = [msgs[i] for i in sorted(pinned + latest)]

    def chosen(k: int) -> list[Any]:
        return lost_in_the_middle(ranked[:k]) if reorder else ranked[:k]

    def fits(k: int) -> bool:
        m, kw = build_messages(base, chosen(k), tokenizer)
        return count_tokens(tokenizer, m, add_generation_prompt, **kw) <= max_prompt_tokens

    if fits(len(ranked)):
        return sel.used, []
    lo, hi = 0, len(ranked) - 1  # the most passages that fit: lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return chosen(lo), [p.id for p in ranked[lo:]]


def _summarize(out: PreparedChat, msgs: list[dict[str, Any]], tok: Any, trimmed: TrimmedHistory, n: int,
               summary: str | None, max_prompt_tokens: int | None, keep_last_turns: int | None,
               add_generation_prompt: bool) -> tuple[TrimmedHistory, list[dict[str, Any]] | None]:
    """The history cut that leaves room for the summary, and the messages with it (None: plain dropping)."""
    reserved: TrimmedHistory | None = trimmed
    if max_prompt_tokens is not None:
        room = n + count_tokens(tok, [summary_message("")], add_generation_prompt=False)
        try:
            reserved = None if room >= max_prompt_tokens else trim_history(
                msgs, tok, max_prompt_tokens=max_prompt_tokens - room, keep_last_turns=keep_last_turns,
                add_generation_prompt=add_generation_prompt)
        except ContextLengthExceededError:
            reserved = None
        if reserved is None:
            out.summary_status, out.summary_source = "skipped", trimmed.dropped
            out.summary_reason = (f"the summary ({room} tokens with its message) does not fit max_prompt_tokens="
                                  f"{max_prompt_tokens} beside the system messages and the latest user turn")
            return trimmed, None
    out.summary_source = reserved.dropped
    out.summary_messages = [msgs[i] for i in reserved.dropped]
    if summary is None:
        out.summary_status = "pending"
        return trimmed, None
    candidate = with_summary(reserved.messages, summary)
    if max_prompt_tokens is not None:
        num = count_tokens(tok, candidate, add_generation_prompt)
        if num > max_prompt_tokens:
            out.summary_status = "skipped"
            out.summary_reason = f"the prompt with the summary has {num} tokens, over max_prompt_tokens=" \
                                 f"{max_prompt_tokens}"
            return trimmed, None
    out.summary_status = "applied"
    return reserved, candidate
