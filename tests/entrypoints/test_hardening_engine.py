"""Liveness, faults and deadlines, in-process: a stalled or dead engine thread fails /health; an exception in one
engine step fails only that step's requests (500 envelope, blocks freed) and the engine keeps serving; a request
past --request-timeout is aborted with a 408 envelope, even when the engine thread is stuck."""

from __future__ import annotations

import asyncio
import threading

from leanserve.config import EngineConfig
from leanserve.engine.async_engine import AsyncEngine, RequestTimeoutError, StepFailedError
from leanserve.engine.llm_engine import LLMEngine
from leanserve.entrypoints.openai.api_server import build_app
from leanserve.sampling_params import SamplingParams

import httpx
import pytest
from test_async_engine import FakeEngine

from tests.conftest import assert_no_leaks


class StallingEngine(FakeEngine):
    """A FakeEngine whose steps block while ``gate`` is clear (a hung kernel, a deadlock)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()

    def step(self):
        self.in_step.set()
        self.gate.wait()
        return super().step()


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://leanserve.test", timeout=60)


async def poll(fn, predicate, timeout: float = 20.0):
    """Call the async ``fn`` until ``predicate(result)``; the last result. Fails after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        result = await fn()
        if predicate(result):
            return result
        assert loop.time() < end, f"not reached within {timeout} s: {result}"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------------------------------ liveness
def test_stalled_engine_turns_health_unhealthy_and_recovers():
    fake = StallingEngine(step_s=0.0)
    engine = AsyncEngine(fake)
    app = build_app(engine, "fake", stall_timeout=0.5)

    async def main():
        async with asgi_client(app) as c:
            assert (await c.get("/health")).status_code == 200
            assert engine.stalled_for() == 0.0  # asleep for lack of work: not a stall
            fake.gate.clear()
            stream = await engine.add_request("r1", "hi", SamplingParams(max_tokens=1000))
            await asyncio.to_thread(fake.in_step.wait, 30)
            r = await poll(lambda: c.get("/health"), lambda r: r.status_code == 503)
            err = r.json()["error"]
            assert err["code"] == "engine_stalled" and "limit 0.5 s" in err["message"]
            fake.gate.set()  # the step returns: healthy again
            await poll(lambda: c.get("/health"), lambda r: r.status_code == 200)
            stream.abort()

    asyncio.run(main())
    engine.shutdown()


def test_dead_engine_thread_fails_health():
    engine = AsyncEngine(FakeEngine(fail_at_step=1))
    app = build_app(engine, "fake")

    async def main():
        async with asgi_client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["error"]["message"] == "the engine is not running"

    asyncio.run(main())
    assert engine.dead is not None and "boom" in repr(engine.dead)
    engine.shutdown()


# -------------------------------------------------------------------------------------------------- deadlines
def test_request_timeout_aborts_the_request():
    fake = FakeEngine(step_s=0.005)
    engine = AsyncEngine(fake, request_timeout=0.3)

    async def main():
        with pytest.raises(RequestTimeoutError) as info:
            async for _ in engine.generate("r1", "hi", SamplingParams(max_tokens=100_000)):
                pass
        assert info.value.timeout == 0.3
        await poll(lambda: asyncio.sleep(0, result=dict(fake.aborted_at_step)), lambda a: "r1" in a)
        # the engine goes on: the next request finishes (no deadline for it: nothing here depends on speed)
        engine.request_timeout = None
        return [o async for o in engine.generate("r2", "hi", SamplingParams(max_tokens=3))]

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "length" and not fake.requests
    engine.shutdown()


def test_request_timeout_fires_while_the_engine_is_stuck():
    """The deadline runs on the caller's loop: a hung step cannot hold the client past it."""
    fake = StallingEngine(step_s=0.0)
    engine = AsyncEngine(fake, request_timeout=0.3)
    app = build_app(engine, "fake")

    async def main():
        fake.gate.clear()
        async with asgi_client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1000})
        assert r.status_code == 408, r.text
        err = r.json()["error"]
        assert err["code"] == "request_timeout" and "0.3 s" in err["message"]
        fake.gate.set()

    asyncio.run(main())
    engine.shutdown()


def test_request_timeout_in_a_stream_ends_it_with_an_error_event():
    fake = FakeEngine(step_s=0.005)
    engine = AsyncEngine(fake, request_timeout=0.3)
    app = build_app(engine, "fake")

    async def main():
        async with asgi_client(app) as c:
            return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100_000, "stream": True})

    r = asyncio.run(main())
    assert r.status_code == 200
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"code":"request_timeout"' in events[-2].replace(" ", "")
    engine.shutdown()


# ------------------------------------------------------------------------------------------------------ faults
@pytest.fixture(scope="module")
def faulty(loaded):
    """A real engine (one sequence at a time) whose model runner raises once, in the first step that runs while
    another request waits: that step's request fails, the waiting one is untouched."""
    llm = LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=512, max_num_seqs=1), loaded=loaded)
    real = llm.runner.execute_model
    state = {"armed": False, "fired": 0}

    def execute_model(sched_out):
        if state["armed"] and llm.scheduler.waiting:
            state["armed"] = False
            state["fired"] += 1
            raise RuntimeError("injected fault")
        return real(sched_out)

    llm.runner.execute_model = execute_model
    engine = AsyncEngine(llm)
    yield llm, engine, state
    engine.shutdown()


def test_fault_in_one_step_fails_only_its_requests(faulty):
    llm, engine, state = faulty
    app = build_app(engine, "m")
    body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "temperature": 0}

    async def main():
        async with asgi_client(app) as c:
            state["armed"] = True
            first = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await poll(lambda: asyncio.sleep(0, result=engine.stats().num_running), lambda n: n == 1)
            second = asyncio.ensure_future(c.post("/v1/completions", json=body))  # waits: max_num_seqs=1
            r1, r2 = await first, await second
            after = await c.post("/v1/completions", json={**body, "max_tokens": 4})
            health = await c.get("/health")
            return r1, r2, after, health

    r1, r2, after, health = asyncio.run(main())
    assert state["fired"] == 1
    assert r1.status_code == 500, r1.text
    err = r1.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_step_failed" and "injected fault" in err["message"]
    assert r2.status_code == 200 and r2.json()["choices"][0]["finish_reason"] == "length"
    assert r2.json()["usage"]["completion_tokens"] == 40
    assert after.status_code == 200 and health.status_code == 200
    assert engine.is_running and engine.num_step_failures == 1
    wait_idle(llm, engine)
    assert_no_leaks(llm)


def test_fault_isolation_on_the_engine_api(faulty):
    """Without HTTP: the failed request's stream raises StepFailedError; the engine stays up."""
    llm, engine, state = faulty

    async def main():
        state["armed"] = True
        a = await engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=30, ignore_eos=True))
        await a.__anext__()  # a is running
        b = await engine.add_request("b", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))
        with pytest.raises(StepFailedError):
            async for _ in a:
                pass
        return [o async for o in b]

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    wait_idle(llm, engine)
    assert_no_leaks(llm)


def wait_idle(llm, engine) -> None:
    """Until the engine thread has dispatched everything (the failed requests' abort outputs included)."""
    async def main():
        await poll(lambda: asyncio.sleep(0, result=(engine.num_in_flight, engine.stats().num_running,
                                                    llm.has_unfinished_requests())),
                   lambda s: s == (0, 0, False))

    asyncio.run(main())


# ---------------------------------------------------------------------------------------- unhandled exceptions
def test_an_unhandled_error_is_a_500_envelope_and_the_connection_stays_open():
    """A bug in a route (here the tokenizer raising) answers 500 in the envelope; the same keep-alive connection
    then serves the next request (uvicorn closes it when Starlette's outermost handler re-raises)."""
    import json
    import socket
    import time

    import uvicorn

    def broken_encode(*args, **kwargs):
        raise RuntimeError("tokenizer bug")

    fake = FakeEngine()
    fake.tokenizer = type("Tok", (), {"encode": staticmethod(broken_encode), "vocab_size": 10})()
    engine = AsyncEngine(fake)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "fake"), host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            stream = sock.makefile("rb")

            def exchange(method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
                sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                status = int(stream.readline().split()[1])
                headers = {}
                while (line := stream.readline()) not in (b"\r\n", b""):
                    k, v = line.decode().split(":", 1)
                    headers[k.strip().lower()] = v.strip()
                assert headers.get("connection") != "close"
                return status, stream.read(int(headers["content-length"]))

            status, body = exchange("POST", "/tokenize", b'{"prompt": "hi"}')
            assert status == 500
            err = json.loads(body)["error"]
            assert err["type"] == "server_error" and "tokenizer bug" in err["message"]
            assert exchange("GET", "/health")[0] == 200  # same socket: still open
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()


# ------------------------------------------------------------------------------------------------------ drain
def test_a_drain_waits_for_server_requests_and_lets_their_later_parts_in():
    """A server request held by the gate counts as in flight before and between its engine requests; during a
    drain a new engine request is refused unless it is part of such a request (``allow_draining``); a request that
    arrives during the drain gets the gate's 503."""
    from leanserve.engine.async_engine import QueueFullError

    engine = AsyncEngine(FakeEngine(step_s=0.002))
    app = build_app(engine, "fake")

    async def main():
        engine.hold()  # the gate's part for a request that arrived before the drain (e.g. a summary computed)
        engine.begin_drain()
        assert engine.num_in_flight == 1  # the drain waits for it although no engine request exists yet
        with pytest.raises(QueueFullError):
            engine.submit("new", engine.admit("hi", SamplingParams(max_tokens=2)))
        stream = engine.submit("part", engine.admit("hi", SamplingParams(max_tokens=2)), allow_draining=True)
        await stream.accepted()
        outs = [o async for o in stream]
        engine.release()
        async with asgi_client(app) as client:
            late = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        return outs, late

    outs, late = asyncio.run(main())
    assert outs[-1].finished and engine.num_in_flight == 0
    assert late.status_code == 503 and late.json()["error"]["message"] == "the server is shutting down"
    engine.shutdown()
