"""The summary of dropped chat turns (``--history-summary-tokens`` / ``history_summary_tokens``), computed by the
served model once per dropped prefix.

When a chat request's history policy drops turns and the summary is on, :func:`summarize_history` asks
:class:`HistorySummarizer` for the summary of the dropped messages: a hit in its LRU
(:class:`~leanserve.context.summary.SummaryCache`, keyed by :func:`~leanserve.context.summary.summary_key`:
served model, token budget, the dropped messages exactly) is reused; a miss runs one internal request through
the same engine (greedy, at most N tokens, id ``leanserve-internal-summary-...``: not a client request, so the
request counters and latency histograms skip it, and no tenant is charged); concurrent requests with the same
key wait for that one computation (single flight). Its prompt and completion tokens are reported in the client
request's ``usage.leanserve.history_summary``. A failed internal request (queue full, timeout, engine error, an
empty answer) does not fail the client request: it falls back to plain dropping, reported ``"failed"`` with the
reason, and nothing is cached (the next request tries again).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from leanserve.context.summary import SummaryCache, summary_key, summary_prompt
from leanserve.engine.async_engine import AsyncEngine
from leanserve.sampling_params import SamplingParams

from fastapi import Request

logger = logging.getLogger(__name__)

INTERNAL_REQUEST_PREFIX = "leanserve-internal-"  # ids of requests the server makes itself (not a client's)
SUMMARY_CACHE_ENTRIES = 256


def is_internal(request_id: str) -> bool:
    return request_id.startswith(INTERNAL_REQUEST_PREFIX)


@dataclass(frozen=True)
class SummaryResult:
    """``text`` None: failed (``error`` says why). ``reused``: from the cache or another request's computation;
    the token counts are those of the internal request this request ran (0 when reused)."""

    text: str | None
    reused: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


class HistorySummarizer:
    """Summaries of one served model: an LRU of finished ones and the computations in flight."""

    def __init__(self, engine: AsyncEngine, model_name: str, max_entries: int = SUMMARY_CACHE_ENTRIES) -> None:
        self.engine, self.model_name = engine, model_name
        self.cache = SummaryCache(max_entries)
        self._pending: dict[str, asyncio.Future] = {}
        self.computed = 0  # internal requests run (for tests and logs)

    async def summarize(self, messages: list[dict[str, Any]], max_tokens: int, tenant: str | None = None
                        ) -> SummaryResult:
        key = summary_key(self.model_name, max_tokens, messages, tenant)  # per tenant, as the answer cache
        text = self.cache.get(key)
        if text is not None:
            return SummaryResult(text, True)
        pending = self._pending.get(key)
        if pending is not None:
            result = await asyncio.shield(pending)
            return SummaryResult(result.text, True, error=result.error)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            result = await self._run(messages, max_tokens)
        except BaseException as exc:  # cancelled: the waiters fall back too
            result = SummaryResult(None, False, error=repr(exc))
            raise
        finally:
            self._pending.pop(key, None)
            if result.text is not None:
                self.cache.put(key, result.text)
            future.set_result(result)
        return result

    async def _run(self, messages: list[dict[str, Any]], max_tokens: int) -> SummaryResult:
        self.computed += 1
        engine = self.engine.engine
        limit = engine.max_model_len - max_tokens
        rid = f"{INTERNAL_REQUEST_PREFIX}summary-{uuid.uuid4().hex[:16]}"
        stream = None
        try:
            ids = await asyncio.to_thread(summary_prompt, messages, self.engine.tokenizer, limit)  # off the loop
            admitted = self.engine.admit(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
            stream = self.engine.submit(rid, admitted, allow_draining=True)  # part of a request admitted before
            await stream.accepted()
            final = None
            async for out in stream:
                final = out
        except Exception as exc:
            logger.warning("history summary request failed: %r", exc)
            return SummaryResult(None, False, error=f"{type(exc).__name__}: {exc}")
        finally:
            if stream is not None:
                stream.abort()
        o = final.outputs[0] if final is not None and final.outputs else None
        text = (o.text if o is not None else "").strip()
        usage = (len(final.prompt_token_ids), len(o.token_ids)) if o is not None else (0, 0)
        if not text:
            return SummaryResult(None, False, *usage, error="the model returned an empty summary")
        return SummaryResult(text, False, *usage)


def summarizer_of(raw_request: Request, engine: AsyncEngine, model_name: str) -> HistorySummarizer:
    """The app's summarizer of ``model_name`` (made on first use, one per served model)."""
    state = raw_request.app.state
    by_model = getattr(state, "history_summarizers", None)
    if by_model is None:
        by_model = state.history_summarizers = {}
    if model_name not in by_model:
        by_model[model_name] = HistorySummarizer(engine, model_name)
    return by_model[model_name]


async def summarize_history(summarizer: HistorySummarizer, ctx: Any, max_tokens: int,
                            rerender: Callable[[str], tuple[list[int], Any]], fallback: list[int],
                            tenant: str | None = None) -> tuple[list[int], Any]:
    """Token ids and context report of a chat whose policies asked for a summary (``ctx.summary_status ==
    "pending"``): rendered again with the summary (``rerender(text)``, in a worker thread), or ``fallback``
    (plain dropping) with the failure reported."""
    result = await summarizer.summarize(ctx.summary_messages, max_tokens, tenant)
    if result.text is None:
        ctx.summary_status, ctx.summary_reason = "failed", result.error
        ctx.summary_prompt_tokens, ctx.summary_completion_tokens = result.prompt_tokens, result.completion_tokens
        return fallback, ctx
    ids, new_ctx = await asyncio.to_thread(rerender, result.text)  # the policies again, off the event loop
    if new_ctx.summary_status == "applied":
        new_ctx.summary_status = "reused" if result.reused else "computed"
    new_ctx.summary_prompt_tokens, new_ctx.summary_completion_tokens = result.prompt_tokens, \
        result.completion_tokens
    return ids, new_ctx
