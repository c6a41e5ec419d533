"""What chat and completions share: errors in OpenAI's envelope, request parsing, sampling parameters, usage,
timings, SSE framing, disconnect handling and the tracking of one choice's streamed progress."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from leanserve.engine.admission import AdmittedRequest
from leanserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestTimeoutError,
    StepFailedError,
)
from leanserve.entrypoints.openai import limits as request_limits
from leanserve.entrypoints.openai.metrics import summarize
from leanserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    SamplingFields,
    Timings,
    TokenizeRequest,
    UsageInfo,
)
from leanserve.entrypoints.openai.tenants import TENANT_KEY
from leanserve.errors import ContextLengthExceededError, InvalidParameterError, KVCapacityError
from leanserve.outputs import CompletionOutput, Logprob, RequestOutput
from leanserve.sampling_params import SamplingParams, StructuredOutputsParams

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

MIN_TOP_P = 1e-6  # smaller positive top_p values are served as this one (the same single most likely token)
ARRIVAL_KEY = "leanserve.arrival_time"  # ASGI scope key set by the arrival-time middleware (time.monotonic)
M = TypeVar("M", bound=BaseModel)


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump(mode="json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def _api_terms(message: str, param_names: dict[str, str] | None) -> str:
    """``message`` with the engine's field names (those with an underscore, e.g. ``max_tokens``) renamed to the
    API fields the client sent (``max_completion_tokens``)."""
    for engine_name, api_name in (param_names or {}).items():
        if "_" in engine_name and engine_name != api_name:
            message = re.sub(rf"\b{engine_name}\b", api_name, message)
    return message


def to_openai_error(exc: BaseException, param_names: dict[str, str] | None = None) -> OpenAIError:
    """Map leanserve's typed errors to HTTP errors. ``param_names`` renames SamplingParams fields to API fields."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidParameterError):
        param = (param_names or {}).get(exc.param, exc.param)
        code = "context_length_exceeded" if isinstance(exc, ContextLengthExceededError) else None
        return bad_request(_api_terms(str(exc), param_names), param, code)
    if isinstance(exc, KVCapacityError):
        param = (param_names or {}).get(exc.param, exc.param)
        return bad_request(f"request exceeds the KV cache capacity: {_api_terms(str(exc), param_names)}", param,
                           "kv_cache_capacity_exceeded")
    if isinstance(exc, QueueFullError):
        return OpenAIError(503, str(exc), "server_error", None, "server_overloaded",
                           headers={"Retry-After": str(max(1, round(exc.retry_after)))})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), "server_error", None, "engine_dead")
    if isinstance(exc, StepFailedError):
        return OpenAIError(500, str(exc), "server_error", None, "engine_step_failed")
    if isinstance(exc, RequestTimeoutError):
        return OpenAIError(408, str(exc), "timeout_error", None, "request_timeout")
    if isinstance(exc, request_limits.LimitExceeded):
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return OpenAIError(exc.status, exc.message, kind, exc.param, exc.code,
                           {"Connection": "close"} if exc.status == 413 else None)
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    return OpenAIError(500, f"internal error: {exc!r}", "server_error")


def validation_error(exc: ValidationError) -> OpenAIError:
    err = exc.errors(include_url=False)[0]
    loc = [str(x) for x in err.get("loc", ())]
    if err.get("type") == "json_invalid":
        return bad_request(f"invalid JSON body: {err.get('msg')}")
    where = ".".join(loc)
    return bad_request(f"{where}: {err.get('msg')}" if where else str(err.get("msg")), loc[0] if loc else None)


_LIMIT_KINDS = {ChatCompletionRequest: "chat", CompletionRequest: "completion", TokenizeRequest: "tokenize",
                DetokenizeRequest: "detokenize"}


async def parse_body(raw_request: Request, model: type[M]) -> M:
    """The request body validated as ``model``, within the app's :class:`~.limits.RequestLimits`
    (``app.state.limits``). Raises OpenAIError: 400 for bad JSON or fields, nesting too deep or a list too long;
    413 for a body over the size limit."""
    limits = getattr(raw_request.app.state, "limits", None) or request_limits.RequestLimits()
    try:
        body = await raw_request.body()
        try:
            data = request_limits.loads(body, limits)
        except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, or an integer of > 4300 digits
            raise bad_request(f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request("the body must be a JSON object")
        kind = _LIMIT_KINDS.get(model)
        if kind is not None:
            request_limits.check_lists(data, kind, limits)
    except request_limits.LimitExceeded as exc:
        raise to_openai_error(exc) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def arrival_time(raw_request: Request) -> float:
    """When the HTTP request arrived (``time.monotonic``), stamped by the middleware; now if missing."""
    return raw_request.scope.get(ARRIVAL_KEY) or time.monotonic()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    param_names: dict[str, str] | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams of an API request, with ``structured`` as its structured-output constraint. Raises OpenAIError
    400 naming the API field (``param_names`` renames SamplingParams fields to API fields)."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.n > 128:
        raise bad_request(f"n must be at most 128, got {req.n}", "n")
    kwargs: dict[str, Any] = {
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "max_tokens": max_tokens,
        "stop": req.stop,
        "seed": req.seed,
        "logprobs": logprobs,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "stop_token_ids": req.stop_token_ids,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "speculative": req.speculative,
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "structured_outputs": structured,
    }
    for name in ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    top_p = kwargs.get("top_p")
    if isinstance(top_p, float) and 0.0 < top_p < MIN_TOP_P:
        # Any top_p below the most likely token's probability (>= 1/vocab) keeps just that token; below float32's
        # range it would round to 0 in the sampler, which then kept no token (the step failed, a 500).
        kwargs["top_p"] = MIN_TOP_P
    try:
        return SamplingParams(**kwargs)
    except InvalidParameterError as exc:
        raise to_openai_error(exc, param_names) from None


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise OpenAIError(404, f"The model `{requested}` does not exist.", "invalid_request_error", "model",
                          "model_not_found")


def usage_of(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int,
             context: Any = None) -> UsageInfo:
    """Usage; ``context`` (a ``context_policies.RequestContext``) adds ``usage.leanserve`` when a policy or the
    answer cache applied."""
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
                     leanserve=None if context is None else context.report(num_prompt_tokens, num_cached_tokens))


def timings_of(outs: list[RequestOutput]) -> Timings | None:
    """llama.cpp-style timings of a request (of the first prompt for multi-prompt completions)."""
    if not outs:
        return None
    s = summarize(outs[0])

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000.0, 3)

    return Timings(prompt_n=sum(len(o.prompt_token_ids) for o in outs),
                   cached_n=sum(o.num_cached_tokens for o in outs),
                   predicted_n=sum(len(c.token_ids) for o in outs for c in o.outputs),
                   queue_ms=ms(s.queue_time), prompt_ms=ms(s.prefill_time), ttft_ms=ms(s.ttft),
                   decode_ms=ms(s.decode_time), predicted_per_token_ms=ms(s.tpot),
                   predicted_per_second=None if not s.tpot else round(1.0 / s.tpot, 3), e2e_ms=ms(s.e2e_latency),
                   draft_n=sum(c.metrics.num_draft_tokens for o in outs for c in o.outputs if c.metrics),
                   draft_n_accepted=sum(c.metrics.num_accepted_tokens for o in outs for c in o.outputs if c.metrics))


def sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload.model_dump(mode="json", exclude=exclude) if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that calls ``on_close()`` when it ends for any reason: the client may
    disconnect before the body generator even started (then its own cleanup never runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Any]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def clamp_logprob(lp: float) -> float:
    return max(lp, -9999.0)


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of one step's logprob dict, by descending logprob."""
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k] if k > 0 else []


@dataclass
class ChoiceProgress:
    """What was already sent of one choice; deltas are computed from the cumulative outputs, so they are right
    whatever the engine's per-step ``delta_*`` fields hold."""

    num_tokens: int = 0
    num_chars: int = 0
    finished: bool = False

    def advance(self, o: CompletionOutput) -> tuple[str, list[int], list[dict[int, Logprob]]]:
        """New text, token ids and logprob entries of ``o`` since the last call."""
        text = o.text[self.num_chars:]
        tokens = o.token_ids[self.num_tokens:]
        logprobs = o.logprobs[self.num_tokens:] if o.logprobs is not None else []
        self.num_chars = len(o.text)
        self.num_tokens = len(o.token_ids)
        return text, tokens, logprobs


@dataclass
class MultiStream:
    """Merge several request streams (one per prompt) into one async iterator of (prompt index, output)."""

    streams: list[Any]
    _tasks: list[asyncio.Task] = field(default_factory=list)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: Any) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except BaseException as exc:  # noqa: B036 - forwarded to the consumer
                queue.put_nowait((i, exc))

        self._tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        remaining = len(self.streams)
        try:
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        for s in self.streams:
            await s.aclose()


def admit_all(engine: AsyncEngine, prompts: list[str | list[int]], params: SamplingParams,
              param_names: dict[str, str] | None = None) -> list[AdmittedRequest]:
    """Every prompt through the engine's single admission check, before any of them is queued.

    Raises:
        OpenAIError: the engine's verdict in the API's terms (``param_names`` renames engine names to API fields).
    """
    try:
        return [engine.admit(prompt, params) for prompt in prompts]
    except Exception as exc:
        raise to_openai_error(exc, param_names) from None


def owner_of(raw_request: Request) -> tuple[Any, Any] | None:
    """(tenant registry, tenant) of an authenticated request, for :func:`add_all`; None without tenants."""
    tenant = raw_request.scope.get(TENANT_KEY)
    registry = getattr(raw_request.app.state, "tenants", None)
    return (registry, tenant) if tenant is not None and registry is not None else None


async def add_all(engine: AsyncEngine, request_id: str, admitted: list[AdmittedRequest], arrival: float,
                  priority: int, owner: tuple[Any, Any] | None = None) -> list[Any]:
    """Queue admitted requests (ids ``request_id``, or ``request_id-i`` for several) and wait until the engine
    accepted them all; on any failure abort those queued. With ``owner`` (:func:`owner_of`), their tokens are
    charged to that tenant when they finish.

    Raises:
        OpenAIError: 400 when the request has more sequences (prompts x n) than the waiting queue holds (it could
            never be queued whole); 503 when the queue is full or the engine is down; 408 when the request timeout
            passed first.
    """
    total = sum(a.params.n for a in admitted)
    if engine.max_waiting is not None and total > engine.max_waiting:
        raise bad_request(f"the request has {total} sequences (prompts x n) but the server queues at most "
                          f"{engine.max_waiting} (--max-waiting)", "n")
    streams = []
    rids = [request_id if len(admitted) == 1 else f"{request_id}-{i}" for i in range(len(admitted))]
    try:
        for rid, request in zip(rids, admitted, strict=True):
            if owner is not None:
                owner[0].track(rid, owner[1])
            # allowed during a drain: the gate refuses requests arriving after it, this one came before
            streams.append(engine.submit(rid, request, arrival_time=arrival, priority=priority, allow_draining=True))
        for s in streams:
            await s.accepted()
    except BaseException as exc:
        for s in streams:
            s.abort()
        if owner is not None:
            for rid in rids:
                owner[0].untrack(rid)
        if isinstance(exc, Exception):
            raise to_openai_error(exc) from None
        raise
    return streams


async def run_unless_disconnected(raw_request: Request, work: Awaitable[Any], on_disconnect: Any) -> Any:
    """Await ``work``; if the client disconnects first, cancel it, call ``on_disconnect()`` and raise
    :class:`ClientDisconnected`. Detects the disconnect as soon as the server sees it (the ASGI receive channel
    reports ``http.disconnect``), no polling."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        on_disconnect()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""
