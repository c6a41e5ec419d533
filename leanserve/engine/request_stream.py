"""The caller's side of one request served by :class:`~leanserve.engine.async_engine.AsyncEngine`.

A :class:`RequestStream` lives on the caller's event loop. The caller awaits :meth:`RequestStream.accepted` and
iterates its outputs; the engine thread reports back only through :meth:`RequestStream.settle`,
:meth:`RequestStream.deliver` and :meth:`RequestStream.fail`, each of which must run on the stream's own loop
(the engine schedules them with ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from leanserve.errors import LeanserveError
from leanserve.outputs import RequestOutput


class RequestTimeoutError(LeanserveError):
    """The request ran past its deadline (the server's ``--request-timeout``) and was aborted."""

    def __init__(self, message: str, timeout: float) -> None:
        super().__init__(message)
        self.timeout = timeout


class RequestStream:
    """The outputs of one request, as an async iterator that ends after the finished output.

    Args:
        request_id: the request's id.
        loop: the caller's event loop; every method runs on it.
        on_abort: called once with ``request_id`` when the caller gives up before the end (:meth:`abort`,
            :meth:`aclose`, or a cancelled wait); thread-safe on the engine's side.
        timeout: seconds the request may run, counted from ``arrival_time`` (``time.monotonic()``, default now);
            past it the request is aborted and the caller's next wait raises :class:`RequestTimeoutError`. The
            timer runs on the caller's loop, so it fires even when the engine thread is stuck.

    Cancelling a pending ``__anext__`` or :meth:`accepted`, or calling :meth:`aclose` before the end, aborts the
    request.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, on_abort: Callable[[str], None],
                 timeout: float | None = None, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self.timed_out = False
        self._on_abort = on_abort
        self._abort_sent = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        if timeout is not None:  # counted from the HTTP arrival (time.monotonic(), not the loop's own clock)
            elapsed = time.monotonic() - arrival_time if arrival_time is not None else 0.0
            self._timer = loop.call_later(max(0.0, timeout - elapsed), self._expire, timeout)

    # ------------------------------------------------------------------------------------------ caller side
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    async def accepted(self) -> None:
        """Wait until the engine thread added the request (at most one step). Cancelling the wait aborts it.

        Raises:
            QueueFullError: the server began shutting down; EngineDeadError: the engine failed; ValueError: the
                engine already runs a request with this id.
        """
        try:
            await self._accepted
        except asyncio.CancelledError:
            self.abort()
            raise
        except BaseException:
            self._end()
            raise

    def abort(self) -> None:
        """Stop the request (no-op once finished); its last output, finish_reason "abort", is not awaited."""
        if not self.finished:
            self._end()
            self._send_abort()

    async def aclose(self) -> None:
        self.abort()

    def _end(self) -> None:
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _send_abort(self) -> None:
        if not self._abort_sent:
            self._abort_sent = True
            self._on_abort(self.request_id)

    def _expire(self, timeout: float) -> None:
        """The deadline passed (on the stream's loop): abort the request; the caller's next wait raises."""
        self._timer = None
        if self.finished:
            return
        self.timed_out = True
        self._send_abort()
        self.fail(RequestTimeoutError(f"the request ran longer than the server's request timeout of {timeout:g} s "
                                      "and was aborted", timeout))

    # ------------------------------------------------------------------ engine side (on the stream's loop)
    def settle(self, error: BaseException | None) -> None:
        """Report the outcome of the engine's add: None = accepted, else the reason it was not."""
        if error is not None:
            self._end()
        if self._accepted.done():  # the caller was cancelled meanwhile (and aborted the request)
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    def deliver(self, output: RequestOutput) -> None:
        """Queue one output for the caller."""
        self._queue.put_nowait(output)

    def fail(self, exc: BaseException) -> None:
        """End the stream with ``exc``: raised by :meth:`accepted` if it is still pending, else by the next
        ``__anext__``."""
        if not self._accepted.done():
            self._accepted.set_exception(exc)
        else:
            self._queue.put_nowait(exc)
