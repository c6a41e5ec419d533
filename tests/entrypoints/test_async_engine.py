"""AsyncEngine's threading contract, on a fake LLMEngine (no model): outputs flow, cancellation aborts within
one step, the waiting bound, shutdown, errors, and no busy spinning when idle."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from leanserve.engine.admission import AdmittedRequest
from leanserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from leanserve.engine.llm_engine import EngineStats
from leanserve.errors import InvalidParameterError
from leanserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from leanserve.sampling_params import SamplingParams

import pytest


class FakeEngine:
    """One token per request per step (``step_s`` seconds each); records which thread calls it."""

    def __init__(self, step_s: float = 0.01, max_running: int = 100, fail_at_step: int | None = None) -> None:
        self.tokenizer = SimpleNamespace()
        self.max_model_len = 100
        self.step_s = step_s
        self.max_running = max_running
        self.fail_at_step = fail_at_step
        self.requests: dict[str, dict] = {}
        self.pending: list[RequestOutput] = []
        self.processor = SimpleNamespace(parents=self.requests)
        self.threads: set[str] = set()
        self.num_steps = 0
        self.num_calls = 0
        self.aborted_at_step: dict[str, int] = {}

    def _mark(self) -> None:
        self.threads.add(threading.current_thread().name)
        self.num_calls += 1

    def admit(self, prompt, params) -> AdmittedRequest:
        """Admission runs on the caller's thread (it reads fixed settings only): not marked."""
        if prompt == "bad":
            raise InvalidParameterError("prompt", "bad prompt")
        return AdmittedRequest(prompt, [1, 2], params, params.max_tokens)

    def add_admitted(self, request_id, admitted, arrival_time=None, priority=0) -> None:
        self._mark()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = {"tokens": [], "max": admitted.max_tokens, "arrival": arrival_time}

    def _output(self, rid: str, reason: str | None) -> RequestOutput:
        r = self.requests[rid]
        m = RequestMetrics(arrival_time=r["arrival"])
        out = CompletionOutput(index=0, text="x" * len(r["tokens"]), token_ids=list(r["tokens"]),
                               finish_reason=reason, metrics=m)
        return RequestOutput(rid, None, [1, 2], [out], finished=reason is not None, metrics=m)

    def abort_request(self, request_id) -> None:
        self._mark()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if rid in self.requests:
                self.pending.append(self._output(rid, "abort"))
                self.aborted_at_step[rid] = self.num_steps
                del self.requests[rid]

    def has_unfinished_requests(self) -> bool:
        self._mark()
        return bool(self.requests or self.pending)

    def step(self) -> list[RequestOutput]:
        self._mark()
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("boom")
        time.sleep(self.step_s)
        outs, self.pending = self.pending, []
        for rid in list(self.requests)[: self.max_running]:
            r = self.requests[rid]
            r["tokens"].append(7)
            done = len(r["tokens"]) >= r["max"]
            outs.append(self._output(rid, "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def get_stats(self) -> EngineStats:
        self._mark()
        running = min(len(self.requests), self.max_running)
        return EngineStats(num_running=running, num_waiting=len(self.requests) - running, kv_cache_usage=0.0,
                           num_blocks=10, num_free_blocks=10, prefix_cache_queries=0, prefix_cache_hits=0,
                           num_preemptions=0)


def params(n_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=n_tokens)


def test_generate_streams_until_finished_and_only_the_engine_thread_calls_the_engine():
    fake = FakeEngine()
    engine = AsyncEngine(fake)

    async def main():
        return [out async for out in engine.generate("r1", "hi", params(5))]

    outs = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    engine.shutdown()
    assert fake.threads == {"leanserve-engine"}


def test_cancelling_the_consumer_aborts_within_one_step():
    fake = FakeEngine(step_s=0.02)
    engine = AsyncEngine(fake)

    async def main():
        async def consume():
            async for _ in engine.generate("r1", "hi", params(10_000)):
                pass

        task = asyncio.ensure_future(consume())
        while fake.num_steps < 5:
            await asyncio.sleep(0.005)
        task.cancel()
        cancelled_at = fake.num_steps
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if "r1" in fake.aborted_at_step:
                break
            await asyncio.sleep(0.005)
        return cancelled_at

    cancelled_at = asyncio.run(main())
    assert fake.aborted_at_step["r1"] - cancelled_at <= 1
    engine.shutdown()
    assert not fake.requests


def test_waiting_bound_raises_queue_full():
    fake = FakeEngine(step_s=0.05, max_running=1)
    engine = AsyncEngine(fake, max_waiting=2)

    async def main():
        streams = [await engine.add_request(f"r{i}", "hi", params(3)) for i in range(3)]
        with pytest.raises(QueueFullError) as info:
            await engine.add_request("r3", "hi", params(3))
        assert info.value.retry_after >= 1
        for s in streams:
            async for _ in s:
                pass
        # drained: accepted again
        s = await engine.add_request("r4", "hi", params(1))
        return [o async for o in s]

    outs = asyncio.run(main())
    assert outs[-1].finished
    engine.shutdown()


def test_add_errors_propagate_and_ids_are_unique():
    engine = AsyncEngine(FakeEngine())

    async def main():
        with pytest.raises(InvalidParameterError):
            await engine.add_request("r1", "bad", params(2))
        s = await engine.add_request("r1", "hi", params(50))  # the failed id is free again
        with pytest.raises(ValueError):
            await engine.add_request("r1", "hi", params(2))
        s.abort()

    asyncio.run(main())
    engine.shutdown()


def test_shutdown_aborts_in_flight_requests():
    fake = FakeEngine(step_s=0.01)
    engine = AsyncEngine(fake)

    async def main():
        stream = await engine.add_request("r1", "hi", params(10_000))
        first = await stream.__anext__()
        assert not first.finished
        threading.Thread(target=engine.shutdown).start()
        outs = [o async for o in stream]
        with pytest.raises(QueueFullError):
            await engine.add_request("r2", "hi", params(2))
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    engine.shutdown()
    assert not engine.is_running and not fake.requests


def test_idle_engine_does_not_spin():
    fake = FakeEngine()
    engine = AsyncEngine(fake)

    async def main():
        return [o async for o in engine.generate("r1", "hi", params(2))]

    asyncio.run(main())
    time.sleep(0.05)
    calls = fake.num_calls
    time.sleep(0.3)
    assert fake.num_calls == calls  # asleep on the condition, not polling
    engine.shutdown()


def test_engine_failure_fails_requests_and_health():
    fake = FakeEngine(fail_at_step=3)
    engine = AsyncEngine(fake)

    async def main():
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("r1", "hi", params(100)):
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("r2", "hi", params(2))

    asyncio.run(main())
    assert not engine.is_running
    engine.shutdown()
