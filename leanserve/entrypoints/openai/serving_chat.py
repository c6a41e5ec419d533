"""``POST /v1/chat/completions``: chat template, sampling parameters, streamed (SSE) and whole responses.

Streaming policy: one role chunk per choice first (``{"role": "assistant", "content": ""}``), then content
chunks, then per choice one finishing chunk with an empty delta and its ``finish_reason``; with
``stream_options.include_usage`` every chunk has ``usage: null`` and a usage-only chunk (``choices: []``) comes
just before ``data: [DONE]``. With logprobs, a chunk is sent for every step that produced tokens, carrying
exactly those tokens' logprobs, even when the detokenizer held their text back (its content is then "" and the
text arrives with a later chunk); without logprobs, steps that released no text send nothing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from leanserve.engine.async_engine import AsyncEngine
from leanserve.entrypoints.openai import answer_cache
from leanserve.entrypoints.openai.context_policies import (
    ContextSettings,
    RequestContext,
    question_of,
    render_chat,
    settings_of,
    summary_tokens_of,
)
from leanserve.entrypoints.openai.history_summary import summarize_history, summarizer_of
from leanserve.entrypoints.openai.prompt_logprobs import (
    prompt_logprobs_json,
    requested_prompt_logprobs,
    with_prompt_logprobs,
)
from leanserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
    TopLogprob,
)
from leanserve.entrypoints.openai.serving_common import (
    SSE_DONE,
    ChoiceProgress,
    ClientDisconnected,
    OpenAIError,
    SSEResponse,
    add_all,
    admit_all,
    arrival_time,
    bad_request,
    check_model,
    clamp_logprob,
    new_id,
    owner_of,
    run_unless_disconnected,
    sampling_params,
    sse,
    timings_of,
    to_openai_error,
    top_entries,
    usage_of,
)
from leanserve.entrypoints.openai.structured_fields import constraint_of, tool_plan
from leanserve.entrypoints.openai.tenants import TENANT_KEY
from leanserve.errors import LeanserveError
from leanserve.outputs import Logprob, RequestOutput
from leanserve.sampling_params import MAX_LOGPROBS
from leanserve.structured.tool_template import ToolTemplate as _ToolTemplate
from leanserve.structured.tools import ToolCallDelta, ToolCallParser

from fastapi import Request
from fastapi.responses import JSONResponse, Response

_PARAM_NAMES = {"logprobs": "top_logprobs", "prompt": "messages"}  # SamplingParams / engine name -> API field


class OpenAIServingChat:
    """Serves chat completions for one model through an :class:`AsyncEngine`."""

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.tokenizer

    def render_prompt(self, req: ChatCompletionRequest, raw_request: Request | None = None,
                      tools: list[dict[str, Any]] | None = None, summary: str | None = None
                      ) -> tuple[list[int], RequestContext]:
        """Token ids of the conversation after its context policies (``context_policies.py``): chat template
        applied, encoded without adding special tokens; and what the policies did. ``tools`` (and the history's
        tool calls and results) go to a template that renders tools, else into the hermes-style fallback
        (:func:`leanserve.structured.tools.render_messages`), the history policy still seeing whole tool turns."""
        settings = settings_of(raw_request) if raw_request is not None else None
        tokenizer = self.tokenizer
        if tools or any(m.role == "tool" or m.tool_calls for m in req.messages):
            tokenizer = _ToolTemplate(self.tokenizer, tools)
        return render_chat(req, tokenizer, settings or ContextSettings(), summary)

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival = arrival_time(raw_request)
        check_model(req.model, self.model_name)
        constraint, field = constraint_of(req)
        plan = tool_plan(req, constraint is not None)
        if plan.constraint is not None:
            constraint, field = plan.constraint, "tools"
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                                  "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        names = dict(_PARAM_NAMES)
        if req.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        if field is not None:
            names["structured_outputs"] = field
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, names,
                                 constraint)
        num_prompt_lp = requested_prompt_logprobs(req.prompt_logprobs, req.stream)
        params = with_prompt_logprobs(params, None if req.stream else num_prompt_lp)  # a stream carries none
        limit = self.engine.engine.max_model_len
        if req.history_summary_tokens is not None and req.history_summary_tokens >= limit:
            raise bad_request(f"history_summary_tokens must be less than the model's context length ({limit}), "
                              f"got {req.history_summary_tokens}", "history_summary_tokens")
        # the policies' heavy work (template renders, trimming, passage selection) runs off the event loop
        prompt_ids, ctx = await asyncio.to_thread(self.render_prompt, req, raw_request, plan.tools)
        if ctx.summary_status == "pending":  # the dropped turns' summary (history_summary.py)
            prompt_ids, ctx = await summarize_history(
                summarizer_of(raw_request, self.engine, self.model_name), ctx,
                summary_tokens_of(req, settings_of(raw_request)),
                lambda text: self.render_prompt(req, raw_request, plan.tools, text), prompt_ids,
                getattr(raw_request.scope.get(TENANT_KEY), "name", None))
        ctx.route = getattr(raw_request.state, "route", None)  # sent to a router model (model_routing.py)
        request_id = new_id("chatcmpl")
        admitted = admit_all(self.engine, [prompt_ids], params, names)
        ctx.admitted(len(prompt_ids), len(admitted[0].prompt_token_ids), params.truncate_prompt_tokens)
        (stream,), ctx.cache = await answer_cache.submit(
            raw_request, "chat", admitted, arrival, req.cache,
            lambda a: add_all(self.engine, request_id, a, arrival, req.priority, owner_of(raw_request)),
            question_of(req))
        created = int(time.time())
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(stream, request_id, created, params.n, top_n, include_usage, ctx, plan.parse)
            return answer_cache.mark(SSEResponse(body, on_close=stream.abort), ctx.cache)

        async def collect() -> RequestOutput:
            final = None
            async for out in stream:
                final = out
            return final

        try:
            final = await run_unless_disconnected(raw_request, collect(), stream.abort)
        except ClientDisconnected:
            return Response(status_code=499)
        except LeanserveError as exc:  # the request timed out, its engine step failed, or the engine died
            raise to_openai_error(exc) from None
        return answer_cache.mark(JSONResponse(self._response(final, request_id, created, top_n, ctx, plan.parse)
                                              .model_dump(mode="json")), ctx.cache)

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int | None
                  ) -> ChatLogprobs | None:
        if top_n is None:
            return None
        content = []
        for tid, entry in zip(token_ids, entries, strict=False):
            chosen = entry.get(tid)
            tops = [self._top(t, lp) for t, lp in top_entries(entry, top_n)]
            text, raw = self._token(tid, chosen)
            content.append(ChatLogprobToken(token=text, logprob=clamp_logprob(chosen.logprob if chosen else 0.0),
                                            bytes=raw, top_logprobs=tops))
        return ChatLogprobs(content=content)

    def _token(self, tid: int, lp: Logprob | None) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(tid)
        text = lp.decoded_token if lp is not None and lp.decoded_token is not None else raw.decode("utf-8", "replace")
        return text, list(raw)

    def _top(self, tid: int, lp: Logprob) -> TopLogprob:
        text, raw = self._token(tid, lp)
        return TopLogprob(token=text, logprob=clamp_logprob(lp.logprob), bytes=raw)

    def _response(self, final: RequestOutput, request_id: str, created: int, top_n: int | None,
                  ctx: RequestContext | None = None, parse_tools: bool = False) -> ChatCompletionResponse:
        choices = []
        for o in final.outputs:
            logprobs = self._logprobs(o.token_ids, o.logprobs or [], top_n)
            message, reason = ChatResponseMessage(content=o.text), o.finish_reason
            if parse_tools:
                parser = _tool_parser()
                content, deltas = parser.feed(o.text)
                more, rest = parser.finish()
                calls: dict[int, ResponseToolCall] = {}
                for d in deltas + rest:
                    if d.id is not None:
                        calls[d.index] = ResponseToolCall(id=d.id, function=ResponseFunctionCall(name=d.name,
                                                                                                 arguments=""))
                    calls[d.index].function.arguments += d.arguments
                content += more
                message = ChatResponseMessage(content=content or (None if calls else ""),
                                              tool_calls=list(calls.values()))
                reason = "tool_calls" if calls and not parser.incomplete and reason == "stop" else reason
            choices.append(ChatChoice(index=o.index, message=message, logprobs=logprobs,
                                      finish_reason=reason, stop_reason=o.stop_reason))
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=usage_of(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens, ctx),
            timings=timings_of([final]), prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs))

    async def _stream(self, stream, request_id: str, created: int, n: int, top_n: int | None,
                      include_usage: bool, ctx: RequestContext | None = None, parse_tools: bool = False
                      ) -> AsyncIterator[str]:
        exclude = None if include_usage else {"usage"}

        def chunk(choices: list[ChatStreamChoice], **extra) -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices, **extra)
            data = c.model_dump(mode="json", exclude=exclude)
            for ch in data["choices"]:
                ch["delta"] = _drop_none(ch["delta"])
            if data.get("timings") is None:
                data.pop("timings", None)
            return sse(data)

        progress = [ChoiceProgress() for _ in range(n)]
        parsers = [_tool_parser() if parse_tools else None for _ in range(n)]

        def calls_chunk(i: int, deltas: list[ToolCallDelta]) -> str:
            return chunk([ChatStreamChoice(index=i, delta=DeltaMessage(tool_calls=[
                DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                              function=DeltaFunctionCall(name=d.name, arguments=d.arguments)) for d in deltas]))])

        final: RequestOutput | None = None
        try:
            for i in range(n):
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for out in stream:
                final = out if out.finished else final
                for o in out.outputs:
                    p = progress[o.index]
                    if p.finished:
                        continue
                    text, tokens, entries = p.advance(o)
                    parser, deltas, reason = parsers[o.index], [], o.finish_reason
                    if parser is not None:
                        text, deltas = parser.feed(text)
                        if reason is not None:
                            more, rest = parser.finish()
                            text, deltas = text + more, deltas + rest
                            if parser.calls and not parser.incomplete and reason == "stop":
                                reason = "tool_calls"
                    if text or (top_n is not None and tokens):
                        logprobs = self._logprobs(tokens, entries, top_n)
                        yield chunk([ChatStreamChoice(index=o.index, delta=DeltaMessage(content=text),
                                                      logprobs=logprobs)])
                    if deltas:
                        yield calls_chunk(o.index, deltas)
                    if reason is not None:
                        p.finished = True
                        last = out.finished and all(q.finished for q in progress)
                        yield chunk([ChatStreamChoice(index=o.index, delta=DeltaMessage(),
                                                      finish_reason=reason, stop_reason=o.stop_reason)],
                                    timings=timings_of([out]) if last else None)
            if include_usage and final is not None:
                completion_tokens = sum(len(o.token_ids) for o in final.outputs)
                usage = usage_of(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens, ctx)
                yield chunk([], usage=usage)
        except Exception as exc:  # the engine failed mid-stream: report it in the stream
            yield sse(to_openai_error(exc).body())
        finally:
            stream.abort()
        yield SSE_DONE


def _tool_parser() -> ToolCallParser:
    return ToolCallParser(lambda: f"call_{uuid.uuid4().hex[:24]}")


def _drop_none(x: Any) -> Any:
    """``x`` without its None values, at every depth (a delta carries only what it sets)."""
    if isinstance(x, dict):
        return {k: _drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_none(v) for v in x]
    return x


__all__ = ["OpenAIServingChat", "OpenAIError"]
