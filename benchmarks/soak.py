"""Soak test of `leanserve serve` on 127.0.0.1: many requests at twice the server's capacity, with random
disconnects (before the first byte, during prefill, mid-stream), random parameters and hostile bodies; then the
checks of a long-running deployment: 0 leaked KV blocks, 0 hung requests, 0 server errors (5xx), flat memory.

    .venv/bin/python -m benchmarks.soak                       # 10,000 requests, starts its own server
    .venv/bin/python -m benchmarks.soak --requests 2000 --max-num-seqs 8 --json soak.json
    .venv/bin/python -m benchmarks.soak --url http://127.0.0.1:8000 --api-key KEY   # a running server

Capacity is the server's --max-num-seqs (sequences in one step); the script keeps 2x that many requests open.
Exit status 0 when every check holds, 1 otherwise. Only loopback addresses are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

API_KEY = "soak-key"
WORDS = ("river mountain lantern quiet orbit velvet harbor copper meadow signal ember canyon willow prism "
         "thunder saffron glacier echo marble cobalt falcon ivory jungle kettle lemon").split()
KINDS = {"normal": 0.62, "disconnect_before_first_byte": 0.09, "disconnect_in_prefill": 0.09,
         "disconnect_mid_stream": 0.10, "hostile": 0.10}
RSS = "process_resident_memory_bytes"


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    bad_streams: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    rss_mb: list[tuple[int, float]] = field(default_factory=list)  # (requests done, resident MB)
    done: int = 0


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def normal_body(rng: random.Random, model: str, max_model_len: int) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": rng.randint(1, 24), "stream": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": text(rng, rng.randint(1, 40))}]
        if rng.random() < 0.2:
            body["messages"].insert(0, {"role": "system", "content": "Be brief."})
    else:
        body["prompt"] = (text(rng, rng.randint(1, 40)) if rng.random() < 0.7
                          else [rng.randrange(100, 49000) for _ in range(rng.randint(1, 60))])
    if rng.random() < 0.5:
        body["temperature"] = round(rng.uniform(0, 1.5), 2)
    if rng.random() < 0.3:
        body["top_p"] = round(rng.uniform(0.1, 1.0), 2)
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([-1, 1, 5, 40])
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2**32)
    if rng.random() < 0.15:
        body["n"] = 2
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS), "\n\n"]
    if rng.random() < 0.15:
        if chat:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        else:
            body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.1:
        body["ignore_eos"] = True
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def hostile_body(rng: random.Random, model: str, max_request_bytes: int) -> tuple[str, bytes, set[int]]:
    """(path, raw body, acceptable statuses)."""
    choice = rng.randrange(9)
    if choice == 0:
        depth = rng.choice([100, 5000, 200_000])
        return "/v1/chat/completions", b'{"messages": ' + b"[" * depth + b"]" * depth + b"}", {400}
    if choice == 1:
        return "/v1/completions", b'{"prompt": "' + b"a" * (max_request_bytes + 1) + b'"}', {413}
    if choice == 2:
        return "/v1/completions", json.dumps({"model": model, "prompt": "hi", "stop": ["x"] * 1000}).encode(), {400}
    if choice == 3:
        return "/v1/chat/completions", rng.choice([b"{", b"null", b"[1,2]", b'{"messages": "x"}', b"\xff\xfe"]), {400}
    if choice == 4:
        return "/v1/completions", b'{"prompt": "\\udc00 lone"}', {400}
    if choice == 5:
        return "/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 6000 + b"}", {400}
    if choice == 6:
        body = {"model": model, "prompt": [rng.randrange(100, 49000) for _ in range(20000)]}
        return "/v1/completions", json.dumps(body).encode(), {400}  # longer than the context
    if choice == 7:
        bad = rng.choice([{"temperature": -1}, {"top_p": 7}, {"n": "2"}, {"max_tokens": 0}, {"logprobs": 99},
                          {"messages": [{"role": "robot", "content": "x"}]}, {"model": "nope"}])
        return "/v1/chat/completions", json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}],
                                                   **bad}).encode(), {400, 404}
    return "/tokenize", json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}] * 5000}).encode(), \
        {400}


def raw_http(host: str, port: int, path: str, body: bytes, api_key: str | None) -> bytes:
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, model: str, max_model_len: int) -> None:
        self.args, self.url, self.model, self.max_model_len = args, url, model, max_model_len
        u = urlparse(url)
        self.host, self.port = u.hostname, u.port
        self.tally = Tally()
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.next = 0
        self.deadline = time.monotonic() + args.time_limit

    def record(self, where: str, status: int, expected: set[int] | None = None) -> None:
        t = self.tally
        t.statuses[status] += 1
        if status >= 500:
            t.server_errors.append(f"{where}: {status}")
        elif expected is not None and status not in expected:
            t.unexpected.append(f"{where}: {status} (expected {sorted(expected)})")

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(self.args.seed * 1_000_003 + i)
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        self.tally.kinds[kind] += 1
        try:
            await asyncio.wait_for(getattr(self, kind)(client, rng, i), self.args.request_timeout)
        except TimeoutError:
            self.tally.hung.append(f"#{i} {kind}")

    async def normal(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> None:
        path, body = normal_body(rng, self.model, self.max_model_len)
        if not body["stream"]:
            r = await client.post(path, json=body)
            self.record(f"#{i} {path}", r.status_code, {200})
            return
        async with client.stream("POST", path, json=body) as r:
            raw = (await r.aread()).decode()
        self.record(f"#{i} {path} stream", r.status_code, {200})
        if r.status_code == 200:
            events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
            reasons = [c.get("finish_reason") for e in events[:-1] for c in json.loads(e).get("choices", [])
                       if c.get("finish_reason")] if events and events[-1] == "[DONE]" else []
            if not events or events[-1] != "[DONE]" or len(reasons) != body.get("n", 1) or \
                    any("error" in json.loads(e) for e in events[:-1]):
                self.tally.bad_streams.append(f"#{i} {path}: {raw[-200:]!r}")

    async def _socket(self, body: dict | bytes, path: str):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(raw_http(self.host, self.port, path, data, self.args.api_key))
        await writer.drain()
        return reader, writer

    async def disconnect_before_first_byte(self, client, rng: random.Random, i: int) -> None:
        path, body = normal_body(rng, self.model, self.max_model_len)
        _, writer = await self._socket(body, path)
        writer.close()  # gone before the server could answer

    async def disconnect_in_prefill(self, client, rng: random.Random, i: int) -> None:
        ids = [rng.randrange(100, 49000) for _ in range(min(700, self.max_model_len - 64))]
        body = {"model": self.model, "prompt": ids, "max_tokens": 32, "stream": rng.random() < 0.5}
        _, writer = await self._socket(body, "/v1/completions")
        await asyncio.sleep(rng.uniform(0.01, 0.3))
        writer.close()

    async def disconnect_mid_stream(self, client, rng: random.Random, i: int) -> None:
        path, body = normal_body(rng, self.model, self.max_model_len)
        body.update(stream=True, max_tokens=rng.randint(40, 120), ignore_eos=True)
        body.pop("stream_options", None)
        reader, writer = await self._socket(body, path)
        want, seen, buf = rng.randint(1, 6), 0, b""
        try:
            while seen < want:
                chunk = await reader.read(4096)
                if not chunk:
                    break
                buf += chunk
                seen = buf.count(b"data: ")
            status = re.match(rb"HTTP/1\.1 (\d+)", buf)
            if status:
                self.record(f"#{i} {path} mid-stream", int(status.group(1)), {200})
        finally:
            writer.close()

    async def hostile(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> None:
        path, data, expected = hostile_body(rng, self.model, self.args.max_request_bytes)
        r = await client.post(path, content=data, headers={"Content-Type": "application/json"})
        self.record(f"#{i} hostile {path}", r.status_code, expected)
        if r.status_code < 500 and not r.json().get("error"):
            self.tally.unexpected.append(f"#{i} hostile {path}: no error envelope")

    async def worker(self, client: httpx.AsyncClient) -> None:
        while self.next < self.args.requests and time.monotonic() < self.deadline:
            i, self.next = self.next, self.next + 1
            try:
                await self.one(client, i)
            except (httpx.HTTPError, OSError) as exc:
                self.tally.unexpected.append(f"#{i}: {exc!r}")
            self.tally.done += 1
            if self.tally.done % 1000 == 0:
                await self.sample_memory(client)

    async def sample_memory(self, client: httpx.AsyncClient) -> None:
        text_ = (await client.get("/metrics")).text
        m = re.search(rf"^{RSS} (\S+)$", text_, re.M)
        if m:
            mb = float(m.group(1)) / 1e6
            self.tally.rss_mb.append((self.tally.done, mb))
            print(f"  {self.tally.done:6d} requests  rss {mb:7.1f} MB  5xx {len(self.tally.server_errors)}  "
                  f"hung {len(self.tally.hung)}", flush=True)

    async def run(self) -> dict:
        n = self.args.concurrency
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n)
        timeout = httpx.Timeout(self.args.request_timeout, connect=30)
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, limits=limits, timeout=timeout) as c:
            await asyncio.gather(*(self.worker(c) for _ in range(self.args.concurrency)))
            elapsed = time.monotonic() - t0
            idle = await self.wait_idle(c)
            health = (await c.get("/health")).status_code
        return self.report(elapsed, idle, health)

    async def wait_idle(self, client: httpx.AsyncClient, timeout: float = 120.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            m = {}
            for line in (await client.get("/metrics")).text.splitlines():
                g = re.match(r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc)\{.*\} "
                             r"(\S+)$", line)
                if g:
                    m[g.group(1)] = float(g.group(2))
            if (m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0
                    and m.get("vllm:kv_cache_usage_perc") == 0) or time.monotonic() > end:
                return m
            await asyncio.sleep(0.2)

    def report(self, elapsed: float, idle: dict, health: int) -> dict:
        t = self.tally
        rss = t.rss_mb
        drift = (rss[-1][1] - rss[0][1]) if len(rss) >= 2 else 0.0
        checks = {
            "leaked_kv": idle.get("vllm:kv_cache_usage_perc", 1.0) != 0.0,
            "requests_left_in_engine": idle.get("vllm:num_requests_running", 1) + idle.get(
                "vllm:num_requests_waiting", 1),
            "hung": len(t.hung),
            "server_errors": len(t.server_errors),
            "bad_streams": len(t.bad_streams),
            "unexpected_statuses": len(t.unexpected),
            "health_after": health,
            "rss_first_mb": rss[0][1] if rss else None,
            "rss_last_mb": rss[-1][1] if rss else None,
            "rss_drift_mb": round(drift, 1),
        }
        ok = (not checks["leaked_kv"] and checks["requests_left_in_engine"] == 0 and not t.hung
              and not t.server_errors and not t.bad_streams and not t.unexpected and health == 200
              and abs(drift) <= self.args.max_rss_drift_mb and t.done == self.args.requests)
        return {"ok": ok, "requests": t.done, "elapsed_s": round(elapsed, 1),
                "requests_per_s": round(t.done / elapsed, 1) if elapsed else None,
                "concurrency": self.args.concurrency, "kinds": dict(t.kinds),
                "statuses": {str(k): v for k, v in sorted(t.statuses.items())}, "checks": checks,
                "rss_mb": t.rss_mb, "examples": {"server_errors": t.server_errors[:5], "hung": t.hung[:5],
                                                 "bad_streams": t.bad_streams[:3], "unexpected": t.unexpected[:5]}}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "leanserve.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--log-level",
           "warning", "--api-key", args.api_key, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
           str(args.max_model_len), "--kv-cache-memory", str(args.kv_cache_memory), "--max-request-bytes",
           str(args.max_request_bytes), *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stdout:
            m = re.search(r" on (http://127\.0\.0\.1:\d+)", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(600) or not found:
        proc.kill()
        raise RuntimeError("the server did not start")
    return proc, found[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--max-num-seqs", type=int, default=16, help="the server's capacity (sequences per step)")
    p.add_argument("--concurrency", type=int, default=None, help="open requests (default: 2 x --max-num-seqs)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--request-timeout", type=float, default=180.0, help="client-side: a request taking longer hung")
    p.add_argument("--time-limit", type=float, default=3600.0, help="stop sending new requests after this (s)")
    p.add_argument("--max-rss-drift-mb", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="soak a running server instead of starting one (loopback only)")
    p.add_argument("--api-key", default=API_KEY)
    p.add_argument("--server-arg", action="append", default=[], help="extra `leanserve serve` argument (repeat)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    args.concurrency = args.concurrency or 2 * args.max_num_seqs
    proc = None
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            print("error: --url must be a loopback address", file=sys.stderr)
            return 2
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        card = httpx.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"][0]
        print(f"soak: {args.requests} requests, {args.concurrency} open at once, on {url} ({card['id']})", flush=True)
        report = asyncio.run(Soak(args, url, card["id"], card["max_model_len"]).run())
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                report_exit = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                report_exit = None
    if proc is not None:
        report["server_exit_status"] = report_exit
        report["ok"] = report["ok"] and report_exit == 0
    print(json.dumps({k: v for k, v in report.items() if k != "rss_mb"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
