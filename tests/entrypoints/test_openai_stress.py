"""Many requests with random early disconnects: every completed one is well-formed and nothing leaks.

LEANSERVE_STRESS_REQUESTS sets the number of requests (default 200; e.g. 1000 for a longer run).
"""

from __future__ import annotations

import asyncio
import os
import random

import httpx
from server_helpers import sse_chunks, wait_for

NUM_REQUESTS = int(os.environ.get("LEANSERVE_STRESS_REQUESTS", "200"))
CONCURRENCY = 16


def test_random_disconnects_leak_nothing(server):
    rng = random.Random(0)
    outcomes: dict[str, int] = {}

    async def one(i: int) -> None:
        kind = rng.choice(["chat", "completions"])
        stream = rng.random() < 0.5
        drop_after = rng.choice([None, None, 0.0, 0.05, 0.2, 0.5])  # seconds; None: read to the end
        if kind == "chat":
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": f"Say something about {i}"}]}
        else:
            path, body = "/v1/completions", {"prompt": f"Item {i}:"}
        body.update(model=server.model, max_tokens=rng.randint(1, 4), stream=stream, n=rng.choice([1, 1, 2]))

        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as client:
                if stream:
                    async with client.stream("POST", path, json=body) as r:
                        raw = (await r.aread()).decode()
                    assert r.status_code == 200, raw
                    chunks = sse_chunks(raw)
                    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
                else:
                    r = await client.post(path, json=body)
                    assert r.status_code == 200, r.text
                    reasons = [c["finish_reason"] for c in r.json()["choices"]]
                assert len(reasons) == body["n"] and set(reasons) <= {"stop", "length"}, reasons

        try:
            if drop_after is None:
                await run()
                outcomes["completed"] = outcomes.get("completed", 0) + 1
            else:
                await asyncio.wait_for(run(), timeout=drop_after)
                outcomes["completed"] = outcomes.get("completed", 0) + 1
        except TimeoutError:
            outcomes["dropped"] = outcomes.get("dropped", 0) + 1

    async def main() -> None:
        sem = asyncio.Semaphore(CONCURRENCY)

        async def limited(i: int) -> None:
            async with sem:
                await one(i)

        await asyncio.gather(*(limited(i) for i in range(NUM_REQUESTS)))

    asyncio.run(main())
    assert outcomes.get("dropped", 0) > 0 and outcomes.get("completed", 0) > NUM_REQUESTS // 4, outcomes

    def idle() -> bool:
        m = server.metrics()
        return (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0.0)

    wait_for(idle, timeout=30)
    assert server.healthy()
    with server.client() as client:
        r = client.post("/v1/completions", json={"model": server.model, "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
