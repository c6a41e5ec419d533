"""Drives an :class:`LLMEngine` from one background thread for asyncio callers (the HTTP server).

Threading model:
- One engine thread owns the :class:`LLMEngine`: every call into it (``add_request``, ``abort_request``,
  ``step``, ``get_stats``) happens on that thread. Callers never touch the engine; they append commands (add,
  abort) to a list guarded by one ``threading.Condition`` and notify it.
- The thread loops: take the pending commands, apply them, publish a stats snapshot, run one ``step()``
  while there is work, publish again, hand the outputs to the observers (metrics) and then to the requests'
  event loops with one ``loop.call_soon_threadsafe`` per loop per step, and waits (at most ``_FLUSH_WAIT_S``)
  until each loop has run the woken request tasks, so tokens reach the clients before the next step takes the
  CPU (else on a busy machine the clients' TTFT/ITL trail the engine's by a step). With no work and no commands
  it sleeps on the condition (no busy spin).
- Each request has a :class:`RequestStream`: an ``asyncio.Queue`` of :class:`RequestOutput` on the caller's
  loop. Cancelling the coroutine that waits on it (client disconnect) or closing it early queues an abort,
  which the thread applies before its next step: the request stops within one step and its KV blocks are freed.

The waiting queue is bounded: ``max_waiting`` sequences (scheduler waiting + not yet handed to the engine);
beyond it :meth:`AsyncEngine.add_request` raises :class:`QueueFullError` (HTTP 503 with Retry-After).

Liveness and faults: the thread stamps a heartbeat every loop iteration; :meth:`AsyncEngine.stalled_for` says how
long it has been busy without advancing (0 while it sleeps for lack of work), which the server's ``/health``
compares with its stall limit. An exception inside one ``step()`` fails only the requests that step touched (the
running ones; they get :class:`StepFailedError`, their KV blocks are freed) and the loop goes on; when the engine
cannot be repaired that way (no scheduler to inspect, the clean-up itself fails, or
``MAX_CONSECUTIVE_STEP_FAILURES`` steps fail in a row) the thread ends, every request gets
:class:`EngineDeadError` and :attr:`AsyncEngine.dead` is set. Draining (:meth:`AsyncEngine.begin_drain`) refuses
new requests and lets the in-flight ones finish; :meth:`AsyncEngine.begin_shutdown` aborts the rest.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

from leanserve.engine.admission import AdmittedRequest
from leanserve.engine.llm_engine import EngineStats, LLMEngine
from leanserve.engine.request_stream import RequestStream, RequestTimeoutError
from leanserve.errors import LeanserveError
from leanserve.outputs import RequestOutput
from leanserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# Longest wait (seconds) for an event loop to send a step's tokens before the engine thread starts the next step.
_FLUSH_WAIT_S = 0.05
# Steps failing in a row (no successful step between them) after which the engine is declared dead.
MAX_CONSECUTIVE_STEP_FAILURES = 3
SHUTTING_DOWN = "the server is shutting down"

__all__ = ["AsyncEngine", "AsyncEngineStats", "EngineDeadError", "QueueFullError", "RequestTimeoutError",
           "StepFailedError"]


class QueueFullError(LeanserveError):
    """The waiting queue is at its bound (or the server is shutting down); retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(LeanserveError):
    """The engine thread failed or stopped; no request can be served."""


class StepFailedError(LeanserveError):
    """An engine step that ran this request raised; the request was stopped (its KV blocks freed), the engine
    goes on serving the others."""


class EngineObserver(Protocol):
    """Called on the engine thread after every step (and after aborts) with that step's outputs."""

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats) -> None: ...


@dataclass(frozen=True)
class AsyncEngineStats:
    """A snapshot published by the engine thread; ``num_waiting`` includes requests not yet handed over."""

    engine: EngineStats
    num_waiting: int
    num_running: int
    kv_cache_usage: float


@dataclass(frozen=True)
class AddCommand:
    """Hand an admitted request to the engine (applied on the engine thread, in submission order)."""

    request_id: str
    request: AdmittedRequest
    arrival_time: float  # time.monotonic() of the request's arrival
    priority: int
    stream: RequestStream


@dataclass(frozen=True)
class AbortCommand:
    """Abort a request (unknown or finished ids are ignored)."""

    request_id: str


EngineCommand = AddCommand | AbortCommand


class AsyncEngine:
    """Runs ``engine.step()`` on a background thread and streams outputs to asyncio tasks.

    Args:
        engine: the engine; from now on only this object's thread calls it.
        max_waiting: most sequences waiting to be scheduled (None: unbounded).
        request_timeout: seconds a request may run from its arrival before it is aborted with
            :class:`RequestTimeoutError` (None: no limit).
        step_lock: held around each ``engine.step()`` (a context manager; several models in one server share one
            :class:`~leanserve.engine.step_lock.StepLock`); None: no lock.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 request_timeout: float | None = None, step_lock: AbstractContextManager | None = None) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.step_lock = step_lock if step_lock is not None else nullcontext()
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._cond = threading.Condition()
        self._commands: list[EngineCommand] = []  # in submission order
        self._pending_seqs = 0  # sequences submitted but not yet added to the engine
        self._streams: dict[str, RequestStream] = {}
        self._observers: list[EngineObserver] = []
        self._active: set[str] = set()  # engine thread: requests added to the engine and not finished
        self._stopping = False
        self._draining = False
        self._held = 0  # server requests in progress (hold / release), their engine requests in _streams
        self._dead: BaseException | None = None
        self._beat = time.monotonic()  # engine thread: when its loop last advanced
        self._idle = False  # engine thread: asleep on the condition for lack of work
        self.num_step_failures = 0  # steps that raised (isolated or not)
        self._failures_in_a_row = 0
        self._stats: AsyncEngineStats | None = None  # published by the engine thread before __init__ returns
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leanserve-engine", daemon=True)
        self._thread.start()
        self._ready.wait()

    # ------------------------------------------------------------------------------------------ public API
    def add_observer(self, observer: EngineObserver) -> None:
        """Register an observer (e.g. the server's metrics); it runs on the engine thread."""
        self._observers.append(observer)

    @property
    def is_running(self) -> bool:
        """True while the engine thread serves requests (not failed, not shut down)."""
        return self._dead is None and not self._stopping and self._thread.is_alive()

    @property
    def dead(self) -> BaseException | None:
        """What ended the engine thread when it failed (None while it runs or after a clean shutdown)."""
        return self._dead

    @property
    def draining(self) -> bool:
        """True from :meth:`begin_drain` (or a shutdown) on: new requests are refused."""
        return self._draining or self._stopping

    @property
    def num_in_flight(self) -> int:
        """The server requests in progress (:meth:`hold`) while any are, else the requests submitted and not yet
        finished (their streams still registered: the Python API's, or those a server request left behind). Takes
        no lock, so it answers even while the engine thread is stuck holding it."""
        return self._held or len(self._streams)

    def hold(self) -> None:
        """Count a server request in progress (from its arrival, before its engine requests exist, until it
        ends: :meth:`release`), so that a drain waits for it too (event-loop thread)."""
        self._held += 1

    def release(self) -> None:
        self._held -= 1

    def stalled_for(self) -> float:
        """Seconds the engine loop has been busy without completing an iteration (0 while it sleeps idle).

        A step of normal length keeps this below the step's duration; a hung step, a deadlock or a thread that
        died mid-step makes it grow without bound."""
        if self._idle:
            return 0.0
        return max(0.0, time.monotonic() - self._beat)

    def stats(self) -> AsyncEngineStats:
        """The latest snapshot (updated after every step and every batch of commands)."""
        with self._cond:
            stats = self._stats
            if stats is None:  # the engine thread failed before its first snapshot
                zero = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)
                return AsyncEngineStats(zero, self._pending_seqs, 0, 0.0)
            return AsyncEngineStats(stats.engine, stats.num_waiting + self._pending_seqs, stats.num_running,
                                    stats.kv_cache_usage)

    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """:meth:`RequestAdmission.check_prompt`: a prompt that is only echoed must fit the context (thread-safe).

        Raises:
            InvalidParameterError (ContextLengthExceededError among them).
        """
        return self.engine.admission.check_prompt(prompt)

    def admit(self, prompt: str | list[int], params: SamplingParams) -> AdmittedRequest:
        """The engine's single admission check (:meth:`LLMEngine.admit`), run on the caller's thread: it reads
        only fixed settings (tokenizer, vocabulary, max_model_len, pool size).

        Raises:
            InvalidParameterError (ContextLengthExceededError among them), KVCapacityError.
        """
        return self.engine.admit(prompt, params)

    def submit(self, request_id: str, request: AdmittedRequest, arrival_time: float | None = None,
               priority: int = 0, allow_draining: bool = False) -> RequestStream:
        """Queue an admitted request without waiting; ``await stream.accepted()`` reports the engine's verdict.

        ``allow_draining``: queue it during a drain too (a part of a server request that arrived before the drain,
        e.g. the request after its history summary, or a cascade's escalation); refused only once shutting down.

        Raises:
            QueueFullError: too many waiting sequences or shutting down; EngineDeadError: the engine failed;
            ValueError: duplicate id.
        """
        loop = asyncio.get_running_loop()
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        n = request.params.n
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(f"the engine failed: {self._dead!r}")
            if self._stopping or (self._draining and not allow_draining):
                raise QueueFullError(SHUTTING_DOWN, retry_after=5.0)
            waiting = (self._stats.num_waiting if self._stats else 0) + self._pending_seqs
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFullError(f"the server is overloaded: {waiting} sequences are waiting "
                                     f"(limit {self.max_waiting}); retry later")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = RequestStream(request_id, loop, self.abort, self.request_timeout, arrival)
            self._streams[request_id] = stream
            self._commands.append(AddCommand(request_id, request, arrival, priority, stream))
            self._pending_seqs += n
            self._cond.notify()
        return stream

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None, priority: int = 0) -> RequestStream:
        """:meth:`admit`, :meth:`submit`, and wait until the engine accepted it (at most one step).

        Raises:
            what :meth:`admit`, :meth:`submit` and :meth:`RequestStream.accepted` raise.
        """
        stream = self.submit(request_id, self.admit(prompt, params), arrival_time, priority)
        await stream.accepted()
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       arrival_time: float | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; closing or cancelling the iteration aborts it."""
        stream = await self.add_request(request_id, prompt, params, arrival_time, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored). Applied before the next step."""
        with self._cond:
            self._commands.append(AbortCommand(request_id))
            self._cond.notify()

    def begin_drain(self) -> None:
        """Refuse new requests (:class:`QueueFullError`, "shutting down") and let the in-flight ones finish; the
        engine keeps running until :meth:`begin_shutdown`. Does not wait."""
        with self._cond:
            self._draining = True

    def begin_shutdown(self) -> None:
        """Refuse new requests, abort the in-flight ones (they end with finish_reason "abort"), stop the thread.
        Does not wait."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """:meth:`begin_shutdown`, then wait for the engine thread to end."""
        self.begin_shutdown()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -------------------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            with self._cond:
                self._publish_stats()
            self._ready.set()
            has_work = False
            while True:
                with self._cond:
                    while not self._commands and not has_work and not self._stopping:
                        self._idle = True
                        self._cond.wait()
                    self._idle = False
                    self._beat = time.monotonic()
                    commands, self._commands = self._commands, []
                    self._apply(commands)
                    stopping = self._stopping
                    if stopping and self._active:
                        engine.abort_request(list(self._active))
                    self._publish_stats()
                has_work = engine.has_unfinished_requests()
                if has_work:
                    try:
                        with self.step_lock:
                            outputs = engine.step()
                        self._failures_in_a_row = 0
                    except Exception as exc:
                        outputs = self._isolate_step_failure(exc)
                    with self._cond:
                        self._publish_stats()
                    self._wait_flushed(self._dispatch(outputs))
                    has_work = engine.has_unfinished_requests()
                if stopping and not has_work:
                    break
        except BaseException as exc:  # a bug in the engine: fail every request, refuse new ones
            logger.exception("engine thread failed")
            with self._cond:
                self._dead = exc
                commands, self._commands = self._commands, []
                for cmd in commands:
                    if isinstance(cmd, AddCommand):
                        self._pending_seqs -= cmd.request.params.n
            self._fail_all(EngineDeadError(f"the engine failed: {exc!r}"))
        finally:
            with self._cond:
                self._stopping = True
            self._ready.set()
        logger.info("engine thread stopped")

    def _apply(self, commands: list[EngineCommand]) -> None:
        """Apply queued adds and aborts in order (engine thread, under the condition's lock)."""
        for cmd in commands:
            if isinstance(cmd, AbortCommand):
                self.engine.abort_request(cmd.request_id)
                continue
            self._pending_seqs -= cmd.request.params.n
            error: BaseException | None = None
            if self._stopping:
                error = QueueFullError(SHUTTING_DOWN, retry_after=5.0)
            else:
                try:
                    self.engine.add_admitted(cmd.request_id, cmd.request, arrival_time=cmd.arrival_time,
                                             priority=cmd.priority)
                    self._active.add(cmd.request_id)
                except Exception as exc:  # a duplicate id; admission was checked when it was submitted
                    error = exc
            try:
                cmd.stream.loop.call_soon_threadsafe(self._settle, cmd.stream, error)
            except RuntimeError:  # the caller's loop is closed
                self._streams.pop(cmd.request_id, None)

    def _isolate_step_failure(self, exc: Exception) -> list[RequestOutput]:
        """Engine thread, after ``step()`` raised: fail the requests the step touched (every request with a
        choice that is not waiting, plus any whose state the failed step already dropped), free their blocks,
        and return the outputs to dispatch. Re-raises (the thread then dies) when the engine cannot be repaired
        this way."""
        self.num_step_failures += 1
        self._failures_in_a_row += 1
        engine = self.engine
        scheduler = getattr(engine, "scheduler", None)
        processor = getattr(engine, "processor", None)
        if scheduler is None or processor is None or not hasattr(processor, "children_of"):
            raise exc  # nothing to inspect: the thread dies and every request fails
        if self._failures_in_a_row >= MAX_CONSECUTIVE_STEP_FAILURES:
            logger.error("%d engine steps failed in a row; giving up", self._failures_in_a_row)
            raise exc
        logger.exception("engine step failed; failing the requests it ran and serving the others")
        waiting = {r.request_id for r in scheduler.waiting}
        victims = []
        for rid in list(self._active):
            children = processor.children_of(rid) if rid in processor.parents else []
            if not children or any(cid not in waiting for cid in children):
                victims.append(rid)
        error = StepFailedError(f"the engine step running this request failed: {exc!r}")
        with self._cond:
            for rid in victims:
                stream = self._streams.get(rid)
                if stream is not None:
                    try:
                        stream.loop.call_soon_threadsafe(self._fail, rid, error)
                    except RuntimeError:  # the caller's loop is closed
                        self._streams.pop(rid, None)
        # frees their KV blocks; their "abort" outputs come with the next step (metrics see them, the streams are
        # gone by then: _fail runs on each loop before any later delivery)
        engine.abort_request([rid for rid in victims if rid in processor.parents])
        for rid in victims:
            self._active.discard(rid)
        logger.error("engine step failed (%r): failed %d request(s); %d still in the engine", exc, len(victims),
                     len(self._active))
        return []
    def _settle(self, stream: RequestStream, error: BaseException | None) -> None:
        """Runs on the request's event loop: report the outcome of its add to the waiting caller."""
        if error is not None and self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        stream.settle(error)

    def _publish_stats(self) -> None:
        stats = self.engine.get_stats()
        self._stats = AsyncEngineStats(stats, stats.num_waiting, stats.num_running, stats.kv_cache_usage)

    def _dispatch(self, outputs: list[RequestOutput]) -> list[asyncio.AbstractEventLoop]:
        """Hand ``outputs`` to the metrics observers and to their requests' loops; returns the loops used."""
        if not outputs:
            return []
        for out in outputs:
            if out.finished:
                self._active.discard(out.request_id)
        stats = self._stats.engine
        for observer in self._observers:
            try:
                observer.on_step(outputs, stats)
            except Exception:
                logger.exception("engine observer failed")
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutput]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append(out)
        used = []
        for loop, outs in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, outs)
                used.append(loop)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for out in outs:
                    if out.finished:
                        self._streams.pop(out.request_id, None)
        return used

    @staticmethod
    def _wait_flushed(loops: list[asyncio.AbstractEventLoop]) -> None:
        """Block (up to ``_FLUSH_WAIT_S`` per loop) until each loop has run what the last delivery woke: the
        marker goes through two more rounds of the loop's ready queue, after the tasks the queues woke."""
        for loop in loops:
            done = threading.Event()
            try:
                loop.call_soon_threadsafe(lambda lp=loop, ev=done: lp.call_soon(lp.call_soon, ev.set))
            except RuntimeError:
                continue
            done.wait(_FLUSH_WAIT_S)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Runs on the requests' event loop."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.deliver(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                stream.loop.call_soon_threadsafe(self._fail, request_id, exc)
            except RuntimeError:
                self._streams.pop(request_id, None)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(exc)
