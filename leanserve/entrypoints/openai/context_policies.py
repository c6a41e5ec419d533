"""The context policies of one chat request (``leanserve.context``), applied before admission, and their report
(``usage.leanserve``, :class:`~.protocol.ContextUsage`).

Order: passages first (``documents``: de-duplicated, ranked, kept under ``max_context_tokens`` /
``top_k_documents``, written into the last user message or the template's ``documents``), then the history
(``max_prompt_tokens`` / ``keep_last_turns``: the budget counts the passages too, which sit in the latest user
turn and are never dropped), then the chat template; ``truncate_prompt_tokens`` is applied at admission, to the
rendered token ids. A request field overrides the server's default (the flag of the same name); an unset one
takes it. A request that cannot fit after its policy is a 400, as any over-long request. With
``history_summary_tokens`` the dropped turns are replaced by a summary (``history_summary.py``): ``render_chat``
first reports it pending, the server gets the text and renders again with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from leanserve.context.chat import prepare_chat
from leanserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ContextUsage,
    DuplicateDocument,
    HistorySummaryUsage,
    RouteUsage,
)
from leanserve.entrypoints.openai.serving_common import to_openai_error
from leanserve.errors import InvalidParameterError

from fastapi import Request


@dataclass(frozen=True)
class ContextSettings:
    """Server-wide defaults of the policies (``--max-prompt-tokens``, ``--max-context-tokens``,
    ``--top-k-documents``, ``--history-summary-tokens``); None: off unless a request sets it."""

    max_prompt_tokens: int | None = None
    max_context_tokens: int | None = None
    top_k_documents: int | None = None
    history_summary_tokens: int | None = None


def settings_of(raw_request: Request) -> ContextSettings:
    return getattr(raw_request.app.state, "context", None) or ContextSettings()


@dataclass
class RequestContext:
    """What the policies did to one request (filled as they run; :meth:`report` builds ``usage.leanserve``)."""

    active: bool = False
    prompt_tokens_sent: int | None = None  # None: the prompt as admitted (no policy changed it)
    truncated_tokens: int = 0
    dropped_messages: list[int] | None = None
    documents_used: list[str] | None = None
    documents_dropped: list[str] | None = None
    documents_duplicates: dict[str, str] = field(default_factory=dict)
    cache: str | None = None
    summary_status: str | None = None  # prepare_chat's, then computed / reused / failed (history_summary.py)
    summary_source: list[int] | None = None
    summary_messages: list[dict[str, Any]] | None = None
    summary_reason: str | None = None
    summary_prompt_tokens: int = 0
    summary_completion_tokens: int = 0
    route: RouteUsage | None = None  # a router model's decision (model_routing.py)
    replayed_tokens: int = 0  # prompt tokens of the answer-cache hits of a batch that were not cached_tokens

    def admitted(self, num_rendered: int, num_admitted: int, truncate: int | None) -> None:
        """Record what admission's ``truncate_prompt_tokens`` cut from the rendered prompt."""
        if truncate is not None:
            self.active = True
            self.truncated_tokens = num_rendered - num_admitted
        if self.prompt_tokens_sent is None:
            self.prompt_tokens_sent = num_rendered

    def report(self, prompt_tokens: int, cached_tokens: int) -> ContextUsage | None:
        if not self.active and self.cache is None and self.route is None:
            return None
        dups = [DuplicateDocument(id=k, duplicate_of=v) for k, v in self.documents_duplicates.items()]
        return ContextUsage(
            prompt_tokens_sent=self.prompt_tokens_sent if self.prompt_tokens_sent is not None else prompt_tokens,
            prompt_tokens_computed=0 if self.cache == "hit" else prompt_tokens - cached_tokens - self.replayed_tokens,
            truncated_tokens=self.truncated_tokens, dropped_messages=self.dropped_messages,
            documents_used=self.documents_used, documents_dropped=self.documents_dropped,
            documents_duplicates=dups if self.documents_used is not None else None, cache=self.cache,
            history_summary=self._summary(), route=self.route)

    def _summary(self) -> HistorySummaryUsage | None:
        if self.summary_status is None or self.summary_status == "pending":
            return None
        return HistorySummaryUsage(status=self.summary_status, replaces=self.summary_source or [],
                                   prompt_tokens=self.summary_prompt_tokens,
                                   completion_tokens=self.summary_completion_tokens, reason=self.summary_reason)


def _pick(value: int | None, default: int | None) -> int | None:
    return value if value is not None else default


def render_chat(req: ChatCompletionRequest, tokenizer: Any, settings: ContextSettings, summary: str | None = None
                ) -> tuple[list[int], RequestContext]:
    """Token ids of the chat request after its passage and history policies
    (:func:`leanserve.context.chat.prepare_chat`), and what they did; ``summary``: the text of the dropped
    turns' summary, when ``ctx.summary_status`` came back "pending".

    Raises:
        OpenAIError: 400 for a template error, a bad budget, or a conversation whose pinned part (system
            messages, latest user turn with its passages) exceeds ``max_prompt_tokens``.
    """
    documents = None if req.documents is None else [{"id": d.id, "text": d.text} for d in req.documents]
    if req.history_summary_tokens and _pick(req.max_prompt_tokens, settings.max_prompt_tokens) is None \
            and req.keep_last_turns is None:  # nothing would ever be dropped, so nothing summarized
        raise to_openai_error(InvalidParameterError(
            "history_summary_tokens", "history_summary_tokens summarizes the turns that max_prompt_tokens or "
            "keep_last_turns drop; set one of them (or the server's --max-prompt-tokens)"))
    if documents and req.truncate_prompt_tokens is not None:  # its cut would hide documents_used's lie
        raise to_openai_error(InvalidParameterError(
            "truncate_prompt_tokens", "truncate_prompt_tokens cuts the prompt from its start, where the documents "
            "are; with documents, fit them with max_context_tokens / top_k_documents (and the history with "
            "max_prompt_tokens)"))
    try:
        prepared = prepare_chat(
            [m.to_template_dict() for m in req.messages], tokenizer, documents=documents,
            max_context_tokens=_pick(req.max_context_tokens, settings.max_context_tokens),
            top_k_documents=_pick(req.top_k_documents, settings.top_k_documents),
            reorder_documents=req.reorder_documents,
            max_prompt_tokens=_pick(req.max_prompt_tokens, settings.max_prompt_tokens),
            keep_last_turns=req.keep_last_turns, add_generation_prompt=req.add_generation_prompt,
            history_summary_tokens=summary_tokens_of(req, settings), summary=summary)
    except InvalidParameterError as exc:
        raise to_openai_error(exc) from None
    ctx = RequestContext(active=prepared.active, dropped_messages=prepared.dropped_messages,
                         documents_used=prepared.documents_used, documents_dropped=prepared.documents_dropped,
                         documents_duplicates=prepared.documents_duplicates, summary_status=prepared.summary_status,
                         summary_source=prepared.summary_source, summary_messages=prepared.summary_messages,
                         summary_reason=prepared.summary_reason)
    if prepared.active:
        ctx.prompt_tokens_sent = prepared.prompt_tokens_sent
    return prepared.prompt_token_ids, ctx


def summary_tokens_of(req: ChatCompletionRequest, settings: ContextSettings) -> int | None:
    """The request's summary budget N (its field, else the server's flag); None or 0: no summary."""
    return _pick(req.history_summary_tokens, settings.history_summary_tokens) or None


def question_of(req: ChatCompletionRequest) -> tuple[str, Any] | None:
    """(the last message's text, everything else that shapes the prompt) when the last message is the user's:
    the semantic answer cache's query and context."""
    if req.messages[-1].role != "user":
        return None
    rest = [m.to_template_dict() for m in req.messages[:-1]]
    fields = req.model_dump(include={"documents", "max_prompt_tokens", "keep_last_turns", "max_context_tokens",
                                     "top_k_documents", "history_summary_tokens", "reorder_documents",
                                     "add_generation_prompt", "tools",
                                     "tool_choice", "parallel_tool_calls", "response_format"})
    return req.messages[-1].to_template_dict()["content"], [rest, fields]
