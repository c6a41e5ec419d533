"""The ASGI gate in front of the API: what is refused before a route runs.

In order, for every path but ``/health`` and ``/metrics`` (probes and scrapers always get through):
1. draining (SIGTERM): 503 + ``Retry-After`` + ``Connection: close``;
2. the body size: a ``Content-Length`` over ``--max-request-bytes`` is a 413 before a byte is read; a body sent
   without one is counted as it is read (:class:`~leanserve.entrypoints.openai.limits.BodyLimitExceeded`, a 413
   from the route's exception handler);
3. the tenant: the ``Authorization`` key resolved to a tenant (``scope[TENANT_KEY]``; None for none or a wrong key,
   which the route answers with 401), and for a generation request its limits: 429 + ``Retry-After``; an admitted
   request counts as in flight until its response has been sent (streams included) or the client left.

:class:`InternalErrorGuard`, innermost, answers an exception no route handled with a 500 envelope on the same
connection, which stays open for the client's next request.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from leanserve.engine.async_engine import SHUTTING_DOWN, AsyncEngine
from leanserve.entrypoints.openai.limits import BodyLimitExceeded, RequestLimits
from leanserve.entrypoints.openai.serving_common import OpenAIError, to_openai_error
from leanserve.entrypoints.openai.tenants import TENANT_KEY, TenantRegistry

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
DRAIN_RETRY_AFTER_S = 5
# An oversized body is read and dropped (up to this many times the limit) before the 413, so the connection closes
# cleanly and the client reads the answer (closing with unread data resets the connection); past it, closed unread.
DISCARD_FACTOR = 4


async def send_error(send: Any, err: OpenAIError) -> None:
    """Answer with ``err`` in the OpenAI envelope, straight on the ASGI channel."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: dict, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class ServerGate:
    """ASGI middleware: drain, body size and tenant limits (see the module doc)."""

    def __init__(self, app: Any, engine: AsyncEngine, limits: RequestLimits, tenants: TenantRegistry | None
                 ) -> None:
        self.app = app
        self.engine = engine
        self.limits = limits
        self.tenants = tenants

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.engine.draining:
            await send_error(send, OpenAIError(503, SHUTTING_DOWN, "server_error", None, "server_overloaded",
                                               {"Retry-After": str(DRAIN_RETRY_AFTER_S), "Connection": "close"}))
            return
        limit = self.limits.max_request_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            exc = BodyLimitExceeded(limit, int(length))
            if int(length) <= DISCARD_FACTOR * limit:
                await discard_body(receive, DISCARD_FACTOR * limit)
            await send_error(send, OpenAIError(413, exc.message, "invalid_request_error", None, exc.code,
                                               {"Connection": "close"}))
            return
        receive = _counting(receive, limit)
        if scope.get("method") == "POST" and scope.get("path") in GENERATION_PATHS:
            self.engine.hold()  # a drain from now on waits for this request, all its engine requests included
            try:
                await self._admitted(scope, receive, send)
            finally:
                self.engine.release()
            return
        await self._admitted(scope, receive, send)

    async def _admitted(self, scope, receive, send) -> None:
        if self.tenants is None:
            await self.app(scope, receive, send)
            return
        tenant = self.tenants.authenticate(_header(scope, b"authorization"))
        scope[TENANT_KEY] = tenant
        if tenant is None or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        refusal = self.tenants.admit(tenant)
        if refusal is not None:
            headers = {"Retry-After": str(refusal.retry_after), **self.tenants.remaining(tenant)}
            await send_error(send, OpenAIError(429, refusal.message, refusal.type, None, "rate_limit_exceeded",
                                               headers))
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.tenants.release(tenant)


async def discard_body(receive: Any, cap: int) -> None:
    """Read and drop the rest of a request body, at most ``cap`` bytes."""
    dropped = 0
    while dropped <= cap:
        message = await receive()
        if message.get("type") != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _counting(receive: Any, limit: int) -> Any:
    """``receive`` that raises BodyLimitExceeded once more than ``limit`` body bytes came in (after dropping the
    rest of the body, up to ``DISCARD_FACTOR`` times the limit)."""
    received = 0

    async def counted() -> dict:
        nonlocal received
        message = await receive()
        if message.get("type") == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                if message.get("more_body", False):
                    await discard_body(receive, DISCARD_FACTOR * limit - received)
                raise BodyLimitExceeded(limit)
        return message

    return counted


class InternalErrorGuard:
    """ASGI middleware (innermost): an exception escaping a route before its response started becomes a 500 in
    the OpenAI envelope (``to_openai_error``), logged with its traceback.

    Starlette runs an app-level handler for ``Exception`` in its outermost middleware, which answers and then
    re-raises, and uvicorn closes the connection on the re-raise; answered here, the exception ends with the
    response and a keep-alive connection serves the client's next request. An exception after the response
    started (a stream already sending) is re-raised: the connection cannot carry a second response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message.get("type") == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error on %s", scope.get("path"))
            await send_error(send, to_openai_error(exc))
