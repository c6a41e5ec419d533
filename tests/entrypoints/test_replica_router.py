"""The replica routers, the ingress's dispatch path and the fleet's health/metrics, on fake replicas (no Ray, no
model): affinity wins while loads are balanced, load wins past SGLang's thresholds, every path releases its load,
a failure before the first byte retries elsewhere, one after it ends the stream with an error event."""

from __future__ import annotations

import asyncio
import json

from leanserve.core.kv_cache_manager import hash_block
from leanserve.entrypoints.ray_serve.fleet import FleetMonitor, RouterMetrics, merge_metrics
from leanserve.entrypoints.ray_serve.proxy import Dispatcher, routing_hashes, routing_text
from leanserve.entrypoints.ray_serve.router import (
    CacheAwareRouter,
    NoReplicaAvailable,
    PowerOfTwoRouter,
    RoundRobinRouter,
    make_router,
    text_block_hashes,
    token_block_hashes,
)
from leanserve.errors import InvalidParameterError

import pytest
from server_helpers import parse_metrics

NAMES = ["r0", "r1", "r2"]


def tenant_prompt(t: int, q: int) -> list[bytes]:
    return text_block_hashes(f"system: tenant {t} " + "rules " * 200 + f"user: question {q}")


# ---------------------------------------------------------------------------------------------- hashing
def test_token_block_hashes_are_the_engines_chain():
    ids = list(range(40))
    h = token_block_hashes(ids, 16)
    assert len(h) == 2  # the partial third block has none
    assert h[0] == hash_block(b"", ids[:16]) and h[1] == hash_block(h[0], ids[16:32])
    assert token_block_hashes(ids[:33] + [999], 16) == h  # same full blocks, same hashes


def test_text_block_hashes_share_exactly_the_common_prefix():
    a = text_block_hashes("x" * 128 + "tail a", 64)
    b = text_block_hashes("x" * 128 + "tail b", 64)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    c = text_block_hashes("y" + "x" * 127 + "tail a", 64)
    assert c[0] != a[0] and c[1] != a[1]  # chained: a different first block changes every later hash


# ---------------------------------------------------------------------------------------------- policies
def test_cache_aware_affinity_wins_when_balanced():
    r = CacheAwareRouter(NAMES)
    first = [r.choose(tenant_prompt(t, 0)) for t in range(3)]
    assert sorted(first) == NAMES  # new prefixes go to the emptiest index: one tenant per replica
    for q in range(1, 6):
        for t in range(3):
            with r.acquire(r.choose(tenant_prompt(t, q))) as ticket:
                assert ticket.replica == first[t]  # each tenant sticks to its replica
    assert r.decisions["affinity"] == 15 and r.decisions["capacity"] == 3


def test_cache_aware_load_wins_past_both_thresholds():
    r = CacheAwareRouter(NAMES[:2], balance_abs_threshold=4, balance_rel_threshold=1.5)
    home = r.choose(tenant_prompt(0, 0))
    other = "r1" if home == "r0" else "r0"
    tickets = [r.acquire(home) for _ in range(4)]  # 4 vs 0: diff 4 is not > 4: still balanced
    assert r.choose(tenant_prompt(0, 1)) == home
    tickets.append(r.acquire(home))  # 5 vs 0: diff 5 > 4 and 5 > 1.5 * 0: imbalanced
    assert r.choose(tenant_prompt(0, 2)) == other
    assert r.decisions["balance"] == 1
    # the balanced-away request left its prefix on `other` too: both now match, the less loaded one wins
    others = [r.acquire(other) for _ in range(6)]  # 5 vs 6: balanced again
    assert r.choose(tenant_prompt(0, 3)) == home
    assert r.choose(text_block_hashes("unrelated " * 100)) == other  # no match: the smaller index (one prompt vs three)

    for t in tickets + others:
        t.release()


def test_cache_aware_relative_threshold_alone_does_not_trigger():
    r = CacheAwareRouter(NAMES[:2], balance_abs_threshold=2, balance_rel_threshold=3.0)
    home = r.choose(tenant_prompt(0, 0))
    other = "r1" if home == "r0" else "r0"
    held = [r.acquire(home) for _ in range(8)] + [r.acquire(other) for _ in range(3)]
    assert r.choose(tenant_prompt(0, 1)) == home  # diff 5 > 2 but 8 <= 3 * 3: not imbalanced
    held.append(r.acquire(other))
    held += [r.acquire(home) for _ in range(5)]  # 13 vs 4: 13 > 12 and diff 9 > 2
    assert r.choose(tenant_prompt(0, 2)) == other
    for t in held:
        t.release()


def test_cache_aware_low_match_goes_to_the_smallest_index():
    r = CacheAwareRouter(NAMES[:2], cache_threshold=0.5)
    r.choose(text_block_hashes("a" * 64 * 10))  # r0: 10 blocks
    # shares 3 of 10 blocks with r0's prefix: 0.3 <= 0.5, so the emptier r1 takes it
    assert r.choose(text_block_hashes("a" * 64 * 3 + "b" * 64 * 7)) == "r1"
    assert r.choose(text_block_hashes("a" * 64 * 9 + "c" * 64)) == "r0"  # 0.9 > 0.5: affinity


def test_unhealthy_replicas_are_skipped_and_rejoin_with_an_empty_index():
    r = CacheAwareRouter(NAMES[:2])
    home = r.choose(tenant_prompt(0, 0))
    other = "r1" if home == "r0" else "r0"
    r.set_healthy(home, False)
    assert r.choose(tenant_prompt(0, 1)) == other
    r.set_healthy(other, False)
    with pytest.raises(NoReplicaAvailable):
        r.choose(tenant_prompt(0, 2))
    r.set_healthy(home, True)
    assert len(r.replicas[home].index) == 0  # restarted: its cache is gone
    assert r.choose(tenant_prompt(0, 3), exclude=[]) == home
    with pytest.raises(NoReplicaAvailable):
        r.choose(tenant_prompt(0, 4), exclude=[home])


def test_round_robin_cycles_over_healthy_replicas():
    r = RoundRobinRouter(NAMES)
    assert [r.choose() for _ in range(6)] == NAMES * 2
    r.set_healthy("r1", False)
    assert [r.choose() for _ in range(4)] == ["r0", "r2", "r0", "r2"]


def test_power_of_two_prefers_the_less_loaded_of_two():
    r = PowerOfTwoRouter(NAMES[:2], seed=1)
    held = [r.acquire("r0") for _ in range(3)]
    assert {r.choose() for _ in range(20)} == {"r1"}  # of r0 and r1, r1 always has less load
    for t in held:
        t.release()
    r3 = PowerOfTwoRouter(NAMES, seed=3)
    held = [r3.acquire("r2")]
    picks = [r3.choose() for _ in range(300)]
    assert "r2" not in picks  # any pair with r2 loses to the other, idle one
    assert 100 < picks.count("r0") < 200
    held[0].release()


def test_make_router_and_bad_settings():
    assert make_router("round_robin", NAMES).policy == "round_robin"
    with pytest.raises(InvalidParameterError, match="unknown replica router"):
        make_router("random", NAMES)
    with pytest.raises(InvalidParameterError):
        CacheAwareRouter(NAMES, cache_threshold=1.5)
    with pytest.raises(InvalidParameterError):
        CacheAwareRouter(["a", "a"])


def test_ticket_release_is_idempotent():
    r = RoundRobinRouter(NAMES)
    t = r.acquire("r0")
    t.release()
    t.release()
    assert r.replicas["r0"].in_flight == 0 and r.replicas["r0"].routed == 1


# ---------------------------------------------------------------------------------------------- routing key
def test_routing_text_of_chat_and_completions():
    chat = json.dumps({"messages": [{"role": "system", "content": "S"}, {"role": "user",
                                                                          "content": [{"type": "text", "text": "Q"}]}]})
    assert routing_text("/v1/chat/completions", chat.encode()) == "system\x00S\x01user\x00Q\x01"
    longer = json.dumps({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                      {"role": "assistant", "content": "A"}]})
    assert routing_text("/v1/chat/completions", longer.encode()).startswith(
        routing_text("/v1/chat/completions", chat.encode()))
    assert routing_text("/v1/completions", b'{"prompt": "hello"}') == "hello"
    assert routing_text("/v1/completions", b'{"prompt": ["a", "b"]}') == "a"
    assert routing_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == "1 2 3"
    assert routing_text("/v1/completions", b"not json") is None
    assert routing_text("/v1/completions", b"[1]") is None
    assert routing_text("/v1/models", b"") is None
    assert routing_hashes("/v1/completions", b'{"prompt": 5}') == []


# ---------------------------------------------------------------------------------------------- dispatch
class FakeReplicas:
    """Replica calls that answer a scripted response; ``fail_before`` / ``fail_after`` make one replica raise
    before its first body chunk or after its first one; ``block`` makes it wait forever after the first."""

    def __init__(self, sse: bool = True, chunks: int = 3) -> None:
        self.sse = sse
        self.chunks = chunks
        self.fail_before: set[str] = set()
        self.fail_after: set[str] = set()
        self.block: set[str] = set()
        self.calls: list[str] = []
        self.closed: list[str] = []

    async def call(self, name, request):
        self.calls.append(name)
        try:
            if name in self.fail_before:
                raise ConnectionError(f"{name} died")
            ctype = "text/event-stream" if self.sse else "application/json"
            yield {"type": "start", "status": 200, "headers": [["content-type", ctype]]}
            for i in range(self.chunks):
                yield {"type": "body", "body": f"data: {name}-{i}\n\n".encode()}
                if name in self.fail_after:
                    raise ConnectionError(f"{name} died mid-stream")
                if name in self.block:
                    await asyncio.Event().wait()
        finally:
            self.closed.append(name)


class Collect:
    def __init__(self, disconnect_after: int | None = None) -> None:
        self.messages = []
        self.disconnect_after = disconnect_after

    async def send(self, message):
        if self.disconnect_after is not None and len(self.messages) >= self.disconnect_after:
            raise OSError("client gone")
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])


async def _receive():
    await asyncio.Event().wait()


def run(coro):
    return asyncio.run(coro)


def loads(router) -> dict[str, int]:
    return {n: s.in_flight for n, s in router.replicas.items()}


def test_streaming_and_non_streaming_release_their_load():
    router = RoundRobinRouter(NAMES[:2])
    fake = FakeReplicas()

    async def go():
        d = Dispatcher(router, fake.call)
        resp = await d.dispatch({})
        assert loads(router)["r0"] == 1  # in flight until the response ends
        out = Collect()
        await resp(None, _receive, out.send)
        assert out.messages[0]["status"] == 200 and out.body == b"data: r0-0\n\ndata: r0-1\n\ndata: r0-2\n\n"
        assert out.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        fake.sse, fake.chunks = False, 1  # a one-chunk (non-streamed) answer
        resp = await d.dispatch({})
        assert loads(router)["r1"] == 1
        out = Collect()
        await resp(None, _receive, out.send)
        assert out.body == b"data: r1-0\n\n"

    run(go())
    assert loads(router) == {"r0": 0, "r1": 0}
    assert fake.closed == ["r0", "r1"]


def test_client_disconnect_mid_stream_and_before_the_response_release_and_close():
    router = RoundRobinRouter(NAMES[:2])
    fake = FakeReplicas()

    async def go():
        d = Dispatcher(router, fake.call)
        resp = await d.dispatch({})  # r0: the client's send fails on the second chunk
        with pytest.raises(OSError):
            await resp(None, _receive, Collect(disconnect_after=2).send)
        fake.block = {"r1"}
        resp = await d.dispatch({})  # r1: the server cancels the response while the replica is silent
        task = asyncio.ensure_future(resp(None, _receive, Collect().send))
        await asyncio.sleep(0.01)
        assert loads(router)["r1"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        resp = await d.dispatch({})  # r0: dropped before it was sent (the client went first)
        assert loads(router)["r0"] == 1
        await resp.close()
        fake.block, fake.fail_before = set(), set()
        task = asyncio.ensure_future(d.dispatch({}))  # cancelled while it waits for the first chunk
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    assert loads(router) == {"r0": 0, "r1": 0}
    assert sorted(fake.closed) == ["r0", "r0", "r1"]


def test_failure_before_first_byte_retries_on_another_replica():
    router = CacheAwareRouter(NAMES)
    fake = FakeReplicas(sse=False, chunks=1)
    fake.fail_before = {"r0", "r1"}
    failed = []

    async def go():
        d = Dispatcher(router, fake.call, on_failure=lambda n, e: failed.append(n))
        resp = await d.dispatch({}, tenant_prompt(0, 0))
        out = Collect()
        await resp(None, _receive, out.send)
        return d, out

    d, out = run(go())
    assert out.messages[0]["status"] == 200 and out.body == b"data: r2-0\n\n"
    assert fake.calls == ["r0", "r1", "r2"] and failed == ["r0", "r1"] and d.num_retried == 2
    assert loads(router) == {"r0": 0, "r1": 0, "r2": 0}


def test_every_replica_failing_is_a_503_envelope_and_marks_them_unhealthy():
    router = RoundRobinRouter(NAMES[:2])
    fake = FakeReplicas()
    fake.fail_before = {"r0", "r1"}
    resp = run(Dispatcher(router, fake.call).dispatch({}))
    assert resp.status == 503 and ("retry-after", "1") in resp.headers
    err = json.loads(resp.body_bytes())["error"]
    assert err["code"] == "no_healthy_replica" and "r1 died" in err["message"]
    assert router.healthy_names() == [] and loads(router) == {"r0": 0, "r1": 0}
    resp = run(Dispatcher(router, fake.call).dispatch({}))  # nothing healthy: answered without a call
    assert resp.status == 503 and fake.calls == ["r0", "r1"]


def test_failure_mid_stream_ends_with_an_error_event():
    router = RoundRobinRouter(NAMES[:2])
    fake = FakeReplicas()
    fake.fail_after = {"r0"}
    failed = []

    async def go():
        resp = await Dispatcher(router, fake.call, on_failure=lambda n, e: failed.append(n)).dispatch({})
        out = Collect()
        await resp(None, _receive, out.send)
        return out

    out = run(go())
    events = out.body.decode().split("\n\n")
    assert events[0] == "data: r0-0"
    err = json.loads(events[1].removeprefix("data: "))["error"]
    assert err["code"] == "replica_failed" and "r0" in err["message"]
    assert events[2] == "data: [DONE]" and events[3] == ""
    assert failed == ["r0"] and loads(router) == {"r0": 0, "r1": 0}


# ---------------------------------------------------------------------------------------------- fleet
def test_fleet_monitor_degraded_then_recovered():
    router = RoundRobinRouter(NAMES[:2])
    state = {"r0": True, "r1": True}

    async def probe(name):
        if state[name] is None:
            await asyncio.Event().wait()  # hung
        return state[name], "ok" if state[name] else "engine dead"

    async def go():
        mon = FleetMonitor(router, probe, timeout=0.05, probe_failures=1)
        await mon.probe_once()
        assert mon.report()[0] == 200 and mon.report()[1]["status"] == "ok"
        state["r1"] = None
        await mon.probe_once()
        code, body = mon.report()
        assert code == 200 and body["status"] == "degraded" and body["healthy_replicas"] == 1
        assert "no answer" in body["replicas"]["r1"]["detail"] and router.healthy_names() == ["r0"]
        state["r0"] = False
        await mon.probe_once()
        assert mon.report()[0] == 503 and mon.report()[1]["status"] == "unavailable"
        state.update(r0=True, r1=True)
        await mon.probe_once()
        code, body = mon.report()
        assert code == 200 and body["status"] == "ok" and body["replicas"]["r1"]["failures"] == 1
        assert router.healthy_names() == ["r0", "r1"]
        mon2 = FleetMonitor(router, probe, timeout=0.05)  # 2 failed probes in a row take a replica out
        state["r1"] = False
        await mon2.probe_once()
        assert router.healthy_names() == ["r0", "r1"]
        await mon2.probe_once()
        assert router.healthy_names() == ["r0"] and mon2.report()[1]["status"] == "degraded"
        mon2.mark("r0", False, "call failed")  # a failed call: at once
        assert router.healthy_names() == []

    run(go())


def test_merge_metrics_labels_each_replica():
    text = ("# HELP vllm:num_requests_running running\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m"} %d\n'
            "# HELP vllm:prompt_tokens prompt tokens\n# TYPE vllm:prompt_tokens counter\n"
            'vllm:prompt_tokens_total{model_name="m"} %d\n'
            "# HELP vllm:e2e_request_latency_seconds e2e\n# TYPE vllm:e2e_request_latency_seconds histogram\n"
            'vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} %d\n'
            'vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} %d\n'
            'vllm:e2e_request_latency_seconds_count{model_name="m"} %d\n'
            'vllm:e2e_request_latency_seconds_sum{model_name="m"} 0.5\n')
    merged = merge_metrics({"engine-0": text % (1, 10, 1, 2, 2), "engine-1": text % (2, 30, 0, 1, 1), "x": None})
    m = parse_metrics(merged)
    assert m['vllm:num_requests_running{replica="engine-0",model_name="m"}'] == 1
    assert m['vllm:num_requests_running{replica="engine-1",model_name="m"}'] == 2
    assert m["vllm:prompt_tokens_total"] == 40
    assert m['vllm:e2e_request_latency_seconds_count{replica="engine-1",model_name="m"}'] == 1
    assert merged.count("# TYPE vllm:prompt_tokens counter") == 1  # one family, both replicas' samples
    lines = [ln for ln in merged.splitlines() if ln.startswith("vllm:num_requests_running")]
    assert len(lines) == 2


def test_router_metrics_render_the_router_state():
    router = RoundRobinRouter(NAMES[:2])
    t = router.acquire("r1")
    router.set_healthy("r0", False)
    m = parse_metrics(RouterMetrics(NAMES[:2]).render(router, 3, 0.25))
    assert m['leanserve:router_requests_in_flight{replica="r1"}'] == 1
    assert m['leanserve:router_requests_total{replica="r1"}'] == 1
    assert m['leanserve:replica_healthy{replica="r0"}'] == 0
    assert m["leanserve:router_retries_total"] == 3 and m["leanserve:router_decision_seconds_total"] == 0.25
    t.release()


# ---------------------------------------------------------------------------------------------- flags
def test_server_config_replica_fields():
    import argparse

    from leanserve.config import ServerConfig, add_config_args, config_from_args

    p = argparse.ArgumentParser()
    add_config_args(p, ServerConfig)
    sc = config_from_args(ServerConfig, p.parse_args(["--replicas", "3", "--replica-router", "power_of_two",
                                                      "--ray-address", "auto"]))
    assert (sc.replicas, sc.replica_router, sc.ray_address) == (3, "power_of_two", "auto")
    assert ServerConfig().replicas == 1 and ServerConfig().replica_router == "cache_aware"
    with pytest.raises(InvalidParameterError, match="replicas"):
        ServerConfig(replicas=0)
    with pytest.raises(InvalidParameterError, match="replica_router"):
        ServerConfig(replica_router="random")
    with pytest.raises(SystemExit):  # argparse refuses an unknown policy
        p.parse_args(["--replica-router", "random"])
