"""The ingress's request path, without Ray: the routing key of a request, the choice of a replica, the retry of a
request that had sent nothing yet, and the response that streams the replica's messages to the client.

A replica call is any ``call(name, request) -> AsyncIterator[message]`` (the messages of
:mod:`.asgi_bridge`); in the Ray application it is a ``DeploymentHandle.options(stream=True)`` call, in the unit
tests a fake. An exception from the iterator means the replica failed (its process died, Ray could not reach it):

- before the first body chunk: nothing reached the client, so the request is retried on another replica (each
  replica at most once) and the failed one is reported to ``on_failure`` (the fleet takes it out of routing);
- after it: the client already has part of the answer; an SSE stream ends with an error event in the OpenAI
  envelope (code ``replica_failed``) and ``data: [DONE]``, so no client hangs.

Load is counted from the choice to the end of the response on every path (:class:`~.router.LoadTicket` released
in ``finally`` blocks: streamed or not, finished, failed, or the client gone before or during the response).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from leanserve.entrypoints.openai.serving_common import SSE_DONE, OpenAIError, sse
from leanserve.entrypoints.ray_serve.router import LoadTicket, NoReplicaAvailable, Router, text_block_hashes

ReplicaCall = Callable[[str, dict[str, Any]], AsyncIterator[dict[str, Any]]]
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def routing_text(path: str, body: bytes) -> str | None:
    """The text whose prefix decides affinity: the chat messages (role and content, in order, so a longer
    conversation extends its shorter self) or the completion prompt; None for other paths or a body that is not
    a JSON object (the replica answers its 400)."""
    if path not in GENERATION_PATHS:
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    if path == "/v1/chat/completions":
        messages = req.get("messages")
        if not isinstance(messages, list):
            return None
        return "".join(f"{m.get('role')}\x00{_content_text(m.get('content'))}\x01"
                       for m in messages if isinstance(m, dict))
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids: their decimal text keeps the prefix property
        return " ".join(map(str, prompt[:100_000]))
    return prompt if isinstance(prompt, str) else None


def routing_hashes(path: str, body: bytes, block_bytes: int = 64) -> list[bytes]:
    text = routing_text(path, body)
    return text_block_hashes(text, block_bytes) if text else []


def error_envelope(status: int, message: str, code: str, retry_after: float | None = None) -> tuple[int, list, bytes]:
    headers = [["content-type", "application/json"]]
    if retry_after is not None:
        headers.append(["retry-after", f"{retry_after:g}"])
    return status, headers, json.dumps(OpenAIError(status, message, "server_error", None, code).body()).encode()


class ProxiedResponse:
    """An ASGI response: the replica's start and first chunks, then the rest of its messages as they come.

    ``ticket`` is released and the replica's iterator closed when the response ends, however it ends."""

    def __init__(self, status: int, headers: Sequence[Sequence[str]], chunks: list[bytes],
                 rest: AsyncIterator[dict[str, Any]] | None, ticket: LoadTicket | None,
                 on_failure: Callable[[str, BaseException], None] | None = None) -> None:
        self.status = status
        self.headers = [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP]
        self.chunks = chunks
        self.rest = rest
        self.ticket = ticket
        self.on_failure = on_failure
        self.is_sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in self.headers)

    @classmethod
    def error(cls, status: int, message: str, code: str, retry_after: float | None = None) -> ProxiedResponse:
        status, headers, body = error_envelope(status, message, code, retry_after)
        return cls(status, headers, [body], None, None)

    def body_bytes(self) -> bytes:
        """The body of a complete response (one with nothing left to stream)."""
        assert self.rest is None
        return b"".join(self.chunks)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers]})
            for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            while self.rest is not None:
                try:
                    message = await anext(self.rest)
                except StopAsyncIteration:
                    break
                except Exception as exc:  # the replica failed mid-response (a failed send is the client's)
                    await self._failed_mid_stream(exc, send)
                    break
                if message["type"] == "body":
                    await send({"type": "http.response.body", "body": message["body"], "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.close()

    async def _failed_mid_stream(self, exc: Exception, send) -> None:
        name = self.ticket.replica if self.ticket is not None else "?"
        if self.on_failure is not None and self.ticket is not None:
            self.on_failure(name, exc)
        if self.is_sse:
            err = OpenAIError(502, f"replica {name} failed mid-stream ({type(exc).__name__}); the answer is "
                              "incomplete", "server_error", None, "replica_failed")
            await send({"type": "http.response.body", "body": (sse(err.body()) + SSE_DONE).encode(),
                        "more_body": True})

    async def close(self) -> None:
        if self.ticket is not None:
            self.ticket.release()
        if self.rest is not None:
            rest, self.rest = self.rest, None
            with contextlib.suppress(BaseException):
                await rest.aclose()


class Dispatcher:
    """Route, call and retry (see the module docstring).

    Args:
        router: the policy and the replica states.
        call: the replica call.
        on_failure: told ``(replica, exception)`` when a call fails (default: mark the replica unhealthy).
        retry_after: the ``Retry-After`` seconds of the 503 answered when no replica is available.
    """

    def __init__(self, router: Router, call: ReplicaCall,
                 on_failure: Callable[[str, BaseException], None] | None = None, retry_after: float = 1.0) -> None:
        self.router = router
        self.call = call
        self.on_failure = on_failure or (lambda name, exc: router.set_healthy(name, False))
        self.retry_after = retry_after
        self.route_seconds = 0.0  # time spent choosing replicas, all requests (the router's own overhead)
        self.num_routed = 0
        self.num_retried = 0

    def choose(self, hashes: Sequence[bytes], exclude: Sequence[str]) -> str:
        t0 = time.perf_counter()
        try:
            return self.router.choose(hashes, exclude)
        finally:
            self.route_seconds += time.perf_counter() - t0
            self.num_routed += 1

    async def dispatch(self, request: dict[str, Any], hashes: Sequence[bytes] = ()) -> ProxiedResponse:
        """Send ``request`` (the bridge's fields: method, path, query, headers, body) to a replica; return the
        response once its first body chunk (or its end) arrived. A 503 envelope when no replica could answer."""
        tried: list[str] = []
        failure: BaseException | None = None
        while True:
            try:
                name = self.choose(hashes, tried)
            except NoReplicaAvailable:
                break
            if tried:
                self.num_retried += 1
            tried.append(name)
            ticket = self.router.acquire(name)
            messages = self.call(name, request)
            it = aiter(messages)
            start: dict[str, Any] | None = None
            chunks: list[bytes] = []
            done = False
            try:
                while not chunks:
                    try:
                        message = await anext(it)
                    except StopAsyncIteration:
                        done = True
                        break
                    if message["type"] == "start":
                        start = message
                    elif message["type"] == "body":
                        chunks.append(message["body"])
            except BaseException as exc:
                ticket.release()
                with contextlib.suppress(BaseException):
                    await it.aclose()
                if isinstance(exc, Exception):
                    failure = exc
                    self.on_failure(name, exc)
                    continue
                raise  # cancelled: the client went away while we waited
            if start is None:  # the replica ended without an answer: count it as a failure
                ticket.release()
                failure = RuntimeError(f"replica {name} ended the response without a status")
                self.on_failure(name, failure)
                continue
            if done:
                ticket.release()
                return ProxiedResponse(start["status"], start["headers"], chunks, None, None)
            return ProxiedResponse(start["status"], start["headers"], chunks, it, ticket, self.on_failure)
        what = f" (last failure: {type(failure).__name__}: {failure})" if failure is not None else ""
        return ProxiedResponse.error(503, f"no healthy replica could take the request{what}", "no_healthy_replica",
                                     self.retry_after)


async def gather_texts(names: Sequence[str], fetch: Callable[[str], Awaitable[str]],
                       timeout: float) -> dict[str, str | None]:
    """``fetch(name)`` for every name concurrently, each bounded by ``timeout`` s (None for a failure)."""

    async def one(name: str) -> str | None:
        try:
            return await asyncio.wait_for(fetch(name), timeout)
        except Exception:
            return None

    results = await asyncio.gather(*(one(n) for n in names))
    return dict(zip(names, results, strict=True))
