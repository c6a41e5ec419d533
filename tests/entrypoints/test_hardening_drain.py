"""Graceful drain on SIGTERM, on real servers: 4 streams in flight finish inside --shutdown-timeout while new
requests get 503 + Retry-After and /health is 503, then exit 0; past the timeout the rest end with
finish_reason "abort"; a second signal ends the drain at once."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from server_helpers import ServerProcess, wait_for

NUM_STREAMS = 4


def start(shutdown_timeout: float) -> ServerProcess:
    return ServerProcess(["--kv-cache-memory", str(512 << 20), "--max-model-len", "2048", "--max-num-seqs", "8",
                          "--shutdown-timeout", str(shutdown_timeout)]).start()


class Stream(threading.Thread):
    """One streaming completion read to its end; records every event and how many came after ``mark``."""

    def __init__(self, srv: ServerProcess, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.max_tokens = srv, max_tokens
        self.events: list[str] = []
        self.mark: int | None = None
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.srv.model, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(base_url=self.srv.url, headers=self.srv.headers, timeout=300) as c:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[6:])
                            if '"text":"' in line and '"text":""' not in line:
                                self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.started.set()

    def chunks(self) -> list[dict]:
        assert self.error is None, self.error
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        return [json.loads(e) for e in self.events[:-1]]

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for ch in self.chunks() for c in ch["choices"] if c.get("finish_reason")]

    def tokens_after_mark(self) -> int:
        return sum(1 for e in self.events[self.mark:] if '"text":"' in e and '"text":""' not in e)


def start_streams(srv: ServerProcess, max_tokens: int) -> list[Stream]:
    streams = [Stream(srv, max_tokens) for _ in range(NUM_STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120) and s.error is None, s.error
    return streams


def sigterm(srv: ServerProcess, streams: list[Stream]) -> None:
    for s in streams:
        s.mark = len(s.events)
    srv.proc.send_signal(signal.SIGTERM)


def check_refused_while_draining(srv: ServerProcess) -> None:
    """/health turns 503 and a new request gets 503 + Retry-After (asked while the streams are still running)."""
    wait_for(lambda: httpx.get(f"{srv.url}/health", timeout=30).status_code == 503, timeout=30)
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=30,
                   json={"model": srv.model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "shutting down" in err["message"]
    assert httpx.get(f"{srv.url}/metrics", timeout=30).status_code == 200  # scrapers still get through


def test_sigterm_lets_in_flight_streams_finish():
    srv = start(shutdown_timeout=300)
    try:
        streams = start_streams(srv, max_tokens=160)
        sigterm(srv, streams)
        check_refused_while_draining(srv)
        for s in streams:
            s.join(300)
        assert srv.proc.wait(120) == 0
    finally:
        srv.stop()
    for s in streams:
        assert s.finish_reasons() == ["length"]
        assert sum(1 for c in s.chunks() for ch in c["choices"] if ch["text"]) >= 100  # generated to the end
        assert s.tokens_after_mark() > 0
    out = "".join(srv.stdout_lines)
    assert f"draining {NUM_STREAMS} in-flight request(s)" in out and "aborting" not in out


def test_sigterm_past_the_timeout_aborts_the_rest():
    srv = start(shutdown_timeout=3)
    try:
        streams = start_streams(srv, max_tokens=1900)
        sigterm(srv, streams)
        check_refused_while_draining(srv)
        for s in streams:
            s.join(120)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    for s in streams:
        assert s.finish_reasons() == ["abort"]
        assert s.tokens_after_mark() > 0  # they went on generating during the drain
    assert f"aborting {NUM_STREAMS} request(s)" in "".join(srv.stdout_lines)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_second_signal_ends_the_drain_at_once(second):
    srv = start(shutdown_timeout=600)
    try:
        streams = start_streams(srv, max_tokens=1900)
        sigterm(srv, streams)
        wait_for(lambda: httpx.get(f"{srv.url}/health", timeout=30).status_code == 503, timeout=30)
        t0 = time.monotonic()
        srv.proc.send_signal(second)
        for s in streams:
            s.join(120)
        assert srv.proc.wait(60) == 0
        ended_in = time.monotonic() - t0
    finally:
        srv.stop()
    for s in streams:
        assert s.finish_reasons() == ["abort"]
    assert ended_in < 60  # far from the 600 s drain
