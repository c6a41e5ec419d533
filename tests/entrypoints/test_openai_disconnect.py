"""Client disconnects on a server with the default engine settings (a disconnect must stop a 2,000-token request
within a second: the default chunking keeps each step short); the waiting-queue bound, the KV capacity error and
shutdown on a second server with short steps (32-token chunks), a small waiting bound (2) and a KV pool (2912
tokens) smaller than its context (4096)."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import time

import httpx
import pytest
from server_helpers import ServerProcess, wait_for


@pytest.fixture(scope="module")
def default_server():
    srv = ServerProcess([]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def small_server():
    srv = ServerProcess(["--kv-cache-memory", str(128 << 20), "--max-model-len", "4096",
                         "--max-num-batched-tokens", "32", "--max-waiting", "2",
                         "--shutdown-timeout", "0"]).start()  # SIGTERM without a drain (test_hardening_drain.py)
    yield srv
    srv.stop()


def idle(srv: ServerProcess) -> bool:
    m = srv.metrics()
    return (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0.0)


def raw_request(srv: ServerProcess, path: str, body: dict) -> socket.socket:
    """Send an HTTP request on a plain socket (the test closes it to disconnect)."""
    host, port = srv.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {srv.api_key}\r\nContent-Length: {len(data)}\r\n\r\n")
    sock.sendall(head.encode() + data)
    return sock


def long_prompt(seed: int, n: int = 2000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def check_stops_and_next_starts(srv: ServerProcess, sock: socket.socket) -> None:
    m = srv.metrics()
    assert m["vllm:num_requests_running"] >= 1 and m["vllm:kv_cache_usage_perc"] > 0
    t0 = time.monotonic()
    sock.close()
    wait_for(lambda: idle(srv), timeout=1.0)
    elapsed = time.monotonic() - t0
    print(f"disconnect -> idle in {elapsed:.3f} s")
    assert elapsed < 1.0, elapsed
    # a new request starts at once: its queue time is short
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=120,
                   json={"model": srv.model, "prompt": "Hello", "max_tokens": 2}).json()
    assert r["timings"]["queue_ms"] < 500, r["timings"]
    assert r["choices"][0]["finish_reason"] in ("stop", "length")


def test_disconnect_non_streaming_during_prefill(default_server):
    srv = default_server
    sock = raw_request(srv, "/v1/completions", {"model": srv.model, "prompt": long_prompt(1), "max_tokens": 50})
    wait_for(lambda: srv.metrics()["vllm:num_requests_running"] >= 1, timeout=30)
    time.sleep(0.3)  # into the prefill
    check_stops_and_next_starts(srv, sock)
    m = srv.metrics()
    label = f'finished_reason="abort",model_name="{srv.model}"'
    assert m["vllm:request_success_total{" + label + "}"] >= 1


def test_disconnect_streaming_during_prefill(default_server):
    srv = default_server
    sock = raw_request(srv, "/v1/completions", {"model": srv.model, "prompt": long_prompt(2), "max_tokens": 50,
                                                "stream": True})
    sock.settimeout(30)
    assert b"200 OK" in sock.recv(65536)  # the response has started
    wait_for(lambda: srv.metrics()["vllm:num_requests_running"] >= 1, timeout=30)
    check_stops_and_next_starts(srv, sock)


def test_disconnect_streaming_during_decode(default_server):
    srv = default_server
    sock = raw_request(srv, "/v1/completions", {"model": srv.model, "prompt": "Once upon a time", "max_tokens": 300,
                                                "ignore_eos": True, "stream": True})
    sock.settimeout(60)
    received = b""
    while received.count(b"data: ") < 4:  # a few tokens streamed
        received += sock.recv(65536)
    before = srv.metrics()["vllm:generation_tokens_total"]
    check_stops_and_next_starts(srv, sock)
    assert srv.metrics()["vllm:generation_tokens_total"] - before < 300


def test_queue_bound_gives_503_with_retry_after(small_server):
    srv = small_server

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post("/v1/completions", json={"model": srv.model, "prompt": long_prompt(100 + i, 100),
                                                          "max_tokens": 2})

    async def main() -> list[httpx.Response]:
        async with srv.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    responses = asyncio.run(main())
    statuses = sorted(r.status_code for r in responses)
    assert 503 in statuses and 200 in statuses and set(statuses) <= {200, 503}, statuses
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and "waiting" in err["message"]
    assert srv.healthy()
    wait_for(lambda: idle(srv), timeout=30)


def test_kv_capacity_error(small_server):
    srv = small_server
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=60,
                   json={"model": srv.model, "prompt": "Hello", "max_tokens": 3000})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "KV cache" in err["message"] and "2912" in err["message"]
    assert srv.healthy()


def test_sigterm_aborts_in_flight_requests_and_exits_cleanly(small_server):
    srv = small_server
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json={
                "model": srv.model, "messages": [{"role": "user", "content": "Tell me a long story"}],
                "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            payloads = []
            for line in lines:
                if line.startswith("data: "):
                    payloads.append(line[6:])
                if '"content":"' in line and '"content":""' not in line:
                    break
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            payloads += [line[6:] for line in lines if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert reasons == ["abort"]
    assert srv.proc.wait(30) == 0
    assert time.monotonic() - t0 < 15
