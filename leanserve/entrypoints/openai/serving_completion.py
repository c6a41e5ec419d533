"""``POST /v1/completions``: prompts as text, texts, token ids or lists of token ids; echo; legacy logprobs.

Choice ``index`` is ``prompt_index * n + choice_index``. Policies: ``suffix`` is rejected (400); ``echo`` with
``logprobs`` returns the prompt tokens' logprobs (the first ``null``) then the completion's, in the legacy format,
as vLLM (see prompt_logprobs.py, also for vLLM's ``prompt_logprobs`` field); ``echo`` with ``max_tokens: 0``
returns the prompt without generating (with ``logprobs``, after running it through the model). Streaming follows
the chat rules (see serving_chat), with ``text`` instead of ``delta``: the echoed prompt (and its logprobs) comes in
each choice's first chunk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from leanserve.engine.async_engine import AsyncEngine
from leanserve.entrypoints.openai import answer_cache
from leanserve.entrypoints.openai.context_policies import RequestContext
from leanserve.entrypoints.openai.prompt_logprobs import (
    prompt_logprobs_json,
    requested_prompt_logprobs,
    with_prompt_logprobs,
)
from leanserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from leanserve.entrypoints.openai.serving_common import (
    SSE_DONE,
    ChoiceProgress,
    ClientDisconnected,
    MultiStream,
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
from leanserve.entrypoints.openai.structured_fields import constraint_of
from leanserve.errors import InvalidParameterError, LeanserveError
from leanserve.outputs import Logprob, RequestOutput

from fastapi import Request
from fastapi.responses import JSONResponse, Response


class OpenAIServingCompletion:
    """Serves legacy completions for one model through an :class:`AsyncEngine`."""

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.tokenizer

    @staticmethod
    def _prompts(req: CompletionRequest) -> list[str | list[int]]:
        """The request's prompts: one text, texts, one list of token ids, or lists of them."""
        p = req.prompt
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items:
            raise bad_request("prompt must not be empty", "prompt")
        return items

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        arrival = arrival_time(raw_request)
        check_model(req.model, self.model_name)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        num_prompt_lp = requested_prompt_logprobs(req.prompt_logprobs, req.stream,
                                                  req.logprobs if req.echo else None)
        prompts = self._prompts(req)
        echo_only = req.echo and req.max_tokens == 0
        if echo_only and num_prompt_lp is None:
            return await self._echo_only(req, prompts)
        constraint, field = constraint_of(req)
        names = {"structured_outputs": field} if field else None
        # echo of the prompt alone with its logprobs: one token is generated and dropped (as vLLM)
        params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs, names, constraint)
        params = with_prompt_logprobs(params, num_prompt_lp,
                                      "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs")
        # tokenizing runs off the event loop (a long prompt takes a while, with the GIL released)
        admitted = await asyncio.to_thread(admit_all, self.engine, prompts, params, names)
        ctx = RequestContext(route=getattr(raw_request.state, "route", None))  # a router's decision, if any
        if params.truncate_prompt_tokens is not None:
            ctx.admitted(sum(a.num_sent_tokens for a in admitted), sum(len(a.prompt_token_ids) for a in admitted),
                         params.truncate_prompt_tokens)
        request_id = new_id("cmpl")
        streams, ctx.cache = await answer_cache.submit(
            raw_request, "completion", admitted, arrival, req.cache,
            lambda a: add_all(self.engine, request_id, a, arrival, req.priority, owner_of(raw_request)))
        ctx.replayed_tokens = sum(getattr(s, "replayed_tokens", 0) for s in streams)  # hits computed nothing
        created = int(time.time())
        echo = [self._echo(p, a.prompt_token_ids, params.truncate_prompt_tokens) if req.echo else ""
                for p, a in zip(prompts, admitted, strict=True)]
        merged = MultiStream(streams)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(merged, request_id, created, params.n, req.logprobs, echo, include_usage, echo_only,
                                ctx)
            return answer_cache.mark(SSEResponse(body, on_close=lambda: [s.abort() for s in streams]), ctx.cache)

        async def collect() -> list[RequestOutput]:
            finals: list[RequestOutput | None] = [None] * len(streams)
            async for i, out in merged:
                if out.finished:
                    finals[i] = out
            return finals

        try:
            finals = await run_unless_disconnected(raw_request, collect(), lambda: [s.abort() for s in streams])
        except ClientDisconnected:
            return Response(status_code=499)
        except LeanserveError as exc:  # the request timed out, its engine step failed, or the engine died
            raise to_openai_error(exc) from None
        return answer_cache.mark(JSONResponse(self._response(finals, request_id, created, params.n, req.logprobs,
                                                             echo, echo_only, ctx).model_dump(mode="json")),
                                 ctx.cache)

    async def _echo_only(self, req: CompletionRequest, prompts: list[str | list[int]]) -> Response:
        """``echo`` with ``max_tokens: 0``: the prompts, checked as admission checks them (each must fit the
        context) with the request's other parameters, and nothing generated; streamed when asked. Tokenizing
        runs off the event loop, as for any request."""
        sampling_params(req, None, None)  # n, temperature, ... are checked as for any request
        sent_prompts = prompts
        try:
            prompts = await asyncio.to_thread(lambda: [self.engine.check_prompt(p) for p in prompts])
        except InvalidParameterError as exc:
            raise to_openai_error(exc) from None
        choices = []
        for i, (sent, ids) in enumerate(zip(sent_prompts, prompts, strict=True)):
            text = self._echo(sent, ids, None)
            for j in range(req.n):
                choices.append(CompletionResponseChoice(index=i * req.n + j, text=text, finish_reason="length"))
        usage = usage_of(sum(len(ids) for ids in prompts), 0, 0)
        request_id, created = new_id("cmpl"), int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def body() -> AsyncIterator[str]:
                for c in choices:
                    yield sse(CompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                       choices=[c]), exclude={"usage", "timings"})
                if include_usage:
                    yield sse(CompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                       choices=[], usage=usage), exclude={"timings"})
                yield SSE_DONE

            return SSEResponse(body(), on_close=lambda: None)
        resp = CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(resp.model_dump(mode="json", exclude_none=False, exclude={"timings"}))

    def _echo(self, prompt: str | list[int], ids: list[int], truncate: int | None) -> str:
        """The echoed prompt: a text prompt as sent (unless truncated), else its token ids decoded with the
        control tokens (``<|im_start|>``, ...) kept, so that it is the concatenation of the echoed tokens' texts
        (``logprobs.tokens``) and ``text_offset`` indexes into it."""
        if isinstance(prompt, str) and truncate is None:
            return prompt
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None], top_n: int | None,
                  offset: int) -> CompletionLogprobs | None:
        """Legacy logprobs of some tokens; ``offset`` is the character offset of the first one in the text. An
        entry None (the first prompt token's) gives ``null`` logprob and top logprobs."""
        if top_n is None:
            return None
        lp = CompletionLogprobs()
        for tid, entry in zip(token_ids, entries, strict=False):
            if entry is None:
                text = self._text(tid, None)
                lp.tokens.append(text)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                lp.text_offset.append(offset)
                offset += len(text)
                continue
            chosen = entry.get(tid)
            text = self._text(tid, chosen)
            lp.tokens.append(text)
            lp.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            tops = {self._text(t, x): clamp_logprob(x.logprob) for t, x in top_entries(entry, top_n)}
            if chosen is not None:
                tops.setdefault(text, clamp_logprob(chosen.logprob))
            lp.top_logprobs.append(tops)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def _text(self, tid: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.token_bytes(tid).decode("utf-8", "replace")

    def _with_prompt(self, final: RequestOutput, token_ids: list[int], entries: list[dict[int, Logprob]],
                     echo: str, echo_only: bool) -> tuple[list[int], list[dict[int, Logprob] | None], int]:
        """The tokens and logprob entries a choice's legacy logprobs cover, and the text offset of the first: the
        echoed prompt's (when its logprobs were computed) then the completion's (none with ``echo_only``)."""
        if echo_only:
            token_ids, entries = [], []
        if echo and final.prompt_logprobs is not None:
            return final.prompt_token_ids + token_ids, final.prompt_logprobs + entries, 0
        return token_ids, entries, len(echo)

    def _response(self, finals: list[RequestOutput], request_id: str, created: int, n: int, top_n: int | None,
                  echo: list[str], echo_only: bool = False, ctx: RequestContext | None = None
                  ) -> CompletionResponse:
        choices = []
        for i, final in enumerate(finals):
            for o in final.outputs:
                ids, entries, offset = self._with_prompt(final, o.token_ids, o.logprobs or [], echo[i], echo_only)
                logprobs = self._logprobs(ids, entries, top_n, offset)
                choices.append(CompletionResponseChoice(
                    index=i * n + o.index, text=echo[i] + ("" if echo_only else o.text), logprobs=logprobs,
                    finish_reason="length" if echo_only else o.finish_reason,
                    stop_reason=None if echo_only else o.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs)))
        usage = usage_of(sum(len(f.prompt_token_ids) for f in finals),
                         0 if echo_only else sum(len(o.token_ids) for f in finals for o in f.outputs),
                         sum(f.num_cached_tokens for f in finals), ctx)
        return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                  usage=usage, timings=timings_of(finals))

    async def _stream(self, merged: MultiStream, request_id: str, created: int, n: int, top_n: int | None,
                      echo: list[str], include_usage: bool, echo_only: bool = False,
                      ctx: RequestContext | None = None) -> AsyncIterator[str]:
        exclude = None if include_usage else {"usage"}

        def chunk(choices: list[CompletionChoice], **extra) -> str:
            c = CompletionStreamResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                         **extra)
            data = c.model_dump(mode="json", exclude=exclude)
            if data.get("timings") is None:
                data.pop("timings", None)
            return sse(data)

        num_prompts = len(echo)
        progress = [ChoiceProgress() for _ in range(num_prompts * n)]
        offsets = [len(echo[k // n]) for k in range(num_prompts * n)]
        echoed = [False] * (num_prompts * n)
        finals: list[RequestOutput | None] = [None] * num_prompts
        try:
            async for i, out in merged:
                if out.finished:
                    finals[i] = out
                for o in out.outputs:
                    k = i * n + o.index
                    p = progress[k]
                    if p.finished:
                        continue
                    text, tokens, entries = p.advance(o)
                    if echo_only:
                        text, tokens, entries = "", [], []
                    if not echoed[k] and echo[i]:
                        text = echo[i] + text
                        tokens, entries, offsets[k] = self._with_prompt(out, tokens, entries, echo[i], False)
                    echoed[k] = True
                    if text or (top_n is not None and tokens):
                        logprobs = self._logprobs(tokens, entries, top_n, offsets[k])
                        if logprobs is not None:
                            offsets[k] += sum(len(t) for t in logprobs.tokens)
                        yield chunk([CompletionChoice(index=k, text=text, logprobs=logprobs)])
                    if o.finish_reason is not None:
                        p.finished = True
                        last = all(f is not None for f in finals) and all(q.finished for q in progress)
                        reason = "length" if echo_only else o.finish_reason
                        yield chunk([CompletionChoice(index=k, text="", finish_reason=reason,
                                                      stop_reason=None if echo_only else o.stop_reason)],
                                    timings=timings_of(finals) if last else None)
            if include_usage:
                done = [f for f in finals if f is not None]
                usage = usage_of(sum(len(f.prompt_token_ids) for f in done),
                                 0 if echo_only else sum(len(o.token_ids) for f in done for o in f.outputs),
                                 sum(f.num_cached_tokens for f in done), ctx)
                yield chunk([], usage=usage)
        except Exception as exc:
            yield sse(to_openai_error(exc).body())
        finally:
            await merged.aclose()
        yield SSE_DONE
