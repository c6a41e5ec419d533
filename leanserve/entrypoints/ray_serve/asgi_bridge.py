"""Call an ASGI app (a replica's :func:`~leanserve.entrypoints.openai.api_server.build_app`) in-process and hand
its response back message by message, as plain picklable dicts, so that a Ray Serve deployment can stream it to
the ingress chunk by chunk.

Messages: ``{"type": "start", "status": int, "headers": [[name, value], ...]}`` once, then ``{"type": "body",
"body": bytes}`` for every non-empty body chunk the app sends (SSE events one by one, as the app writes them).
Closing the iterator early (the ingress cancelled the call: its client went away) makes the app's ``receive()``
answer ``http.disconnect``, so the server's own disconnect handling aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

_DONE = object()


def http_scope(method: str, path: str, query: bytes, headers: list[tuple[str, str]]) -> dict[str, Any]:
    """An ASGI 3 HTTP scope for one request (``path`` without the query string)."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method.upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": query, "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers], "state": {}}


async def call_asgi(app: Any, method: str, path: str, query: bytes = b"", headers: list[tuple[str, str]] = (),
                    body: bytes = b"", close_timeout: float = 10.0) -> AsyncIterator[dict[str, Any]]:
    """Run ``app`` on one request; yield its response messages (see the module docstring).

    Raises:
        whatever the app raised before it sent its response start (after it, the app's own error handling
        answers; an exception after the start ends the stream).
    """
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set():
            raise OSError("the client disconnected")
        out.put_nowait(message)

    task = asyncio.ensure_future(app(http_scope(method, path, query, list(headers)), receive, send))
    task.add_done_callback(lambda _t: out.put_nowait(_DONE))
    try:
        while True:
            message = await out.get()
            if message is _DONE:
                if task.exception() is not None:
                    raise task.exception()
                return
            if message["type"] == "http.response.start":
                yield {"type": "start", "status": message["status"],
                       "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in message.get("headers", ())]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield {"type": "body", "body": bytes(message["body"])}
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), close_timeout)
            if not task.done():
                task.cancel()
