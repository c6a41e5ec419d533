"""Tenants, in-process (a fake engine behind the real app): a name per key, constant-time key lookup, per-tenant
limits answered with 429 + Retry-After while the other tenants go on, per-tenant metrics, keys never logged;
and the command line (repeated --api-key, --api-keys-file)."""

from __future__ import annotations

import asyncio
import json
import logging

from leanserve.cli import build_parser
from leanserve.config import ServerConfig, config_from_args
from leanserve.engine.async_engine import AsyncEngine
from leanserve.entrypoints.openai.api_server import build_app
from leanserve.entrypoints.openai.tenants import TenantLimits, TenantRegistry, load_keys_file
from leanserve.errors import InvalidParameterError

import httpx
import pytest
from server_helpers import parse_metrics
from test_async_engine import FakeEngine

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-9876543210", "carol": "sk-carol-5555", "dave": "sk-dave-77"}
LIMITS = {"alice": TenantLimits(requests_per_minute=3), "bob": TenantLimits(max_concurrent=1),
          "carol": TenantLimits(tokens_per_minute=20), "dave": TenantLimits()}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup():
    fake = FakeEngine(step_s=0.002)
    fake.tokenizer.encode = lambda text, add_special_tokens=True: [1, 2]  # for /tokenize
    engine = AsyncEngine(fake)
    clock = Clock()
    registry = TenantRegistry([(n, KEYS[n], LIMITS[n]) for n in KEYS], clock=clock)
    app = build_app(engine, "fake", tenants=registry)
    yield app, registry, clock
    engine.shutdown()


def call(app, requests):
    """Run ``requests(client)`` (a coroutine function) against the app."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://leanserve.test",
                                     timeout=60) as c:
            return await requests(c)

    return asyncio.run(main())


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


BODY = {"prompt": "hi", "max_tokens": 3}


def assert_429(r: httpx.Response, kind: str, limit: str) -> dict:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == kind and limit in err["message"]
    assert 1 <= int(r.headers["retry-after"]) <= 60
    return err


def test_each_key_is_its_tenant_and_a_wrong_key_is_401(setup):
    app, registry, _ = setup

    async def requests(c):
        ok = [await c.post("/v1/completions", json=BODY, headers=auth(n)) for n in KEYS]
        bad = [await c.post("/v1/completions", json=BODY, headers=h) for h in
               ({}, {"Authorization": "Bearer sk-nobody"}, {"Authorization": KEYS["alice"]},
                {"Authorization": "Basic " + KEYS["alice"]})]
        return ok, bad

    ok, bad = call(app, requests)
    assert [r.status_code for r in ok] == [200] * 4
    for r in bad:
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert all(k not in r.text for k in KEYS.values())
    assert registry.authenticate(f"Bearer {KEYS['bob']}").name == "bob"
    assert registry.authenticate(f"bearer  {KEYS['bob']} ").name == "bob"
    assert registry.authenticate("Bearer sk-bob") is None


def test_requests_per_minute_gives_429_and_other_tenants_go_on(setup):
    app, registry, clock = setup

    async def requests(c):
        first = [await c.post("/v1/completions", json=BODY, headers=auth("alice")) for _ in range(3)]
        clock.now += 20
        limited = await c.post("/v1/completions", json=BODY, headers=auth("alice"))
        others = [await c.post("/v1/completions", json=BODY, headers=auth(n)) for n in ("bob", "carol", "dave")]
        tokenize = await c.post("/tokenize", json={"prompt": "hi"}, headers=auth("alice"))  # not a generation
        clock.now += 41  # the first request left the window
        again = await c.post("/v1/completions", json=BODY, headers=auth("alice"))
        metrics = await c.get("/metrics")
        return first, limited, others, tokenize, again, metrics

    first, limited, others, tokenize, again, metrics = call(app, requests)
    assert [r.status_code for r in first] == [200, 200, 200]
    err = assert_429(limited, "requests", "requests per minute")
    assert "Limit 3, Used 3" in err["message"] and "tenant alice" in err["message"]
    assert limited.headers["retry-after"] == "40"  # the first of the 3 leaves the window 40 s later
    assert limited.headers["x-ratelimit-limit-requests"] == "3"
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    assert [r.status_code for r in others] == [200, 200, 200] and tokenize.status_code == 200
    assert again.status_code == 200
    m = parse_metrics(metrics.text)
    label = 'model_name="fake",tenant="alice"'
    assert m["leanserve:tenant_requests_total{" + label + "}"] == 4
    assert m['leanserve:tenant_rate_limited_total{limit="requests_per_minute",' + label + "}"] == 1
    assert m['leanserve:tenant_requests_total{model_name="fake",tenant="dave"}'] == 1
    assert m["leanserve:tenant_requests_in_flight{" + label + "}"] == 0
    assert all(k not in metrics.text for k in KEYS.values())


def test_concurrency_limit_gives_429_while_one_is_in_flight(setup):
    app, registry, _ = setup
    bob = registry.by_name["bob"]

    async def requests(c):
        long = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 300},
                                            headers=auth("bob")))
        while bob.in_flight == 0:
            await asyncio.sleep(0.005)
        limited = await c.post("/v1/completions", json=BODY, headers=auth("bob"))
        other = await c.post("/v1/completions", json=BODY, headers=auth("dave"))
        first = await long
        after = await c.post("/v1/completions", json=BODY, headers=auth("bob"))
        return limited, other, first, after

    limited, other, first, after = call(app, requests)
    err = assert_429(limited, "requests", "concurrent requests")
    assert "Limit 1, Used 1" in err["message"] and limited.headers["retry-after"] == "1"
    assert other.status_code == 200 and first.status_code == 200 and after.status_code == 200
    assert bob.in_flight == 0


def test_tokens_per_minute_charges_prompt_and_generated_tokens(setup):
    app, registry, clock = setup

    async def requests(c):
        # the fake engine's prompts are 2 tokens: 2 + 18 = 20 tokens, the whole minute's allowance
        first = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 18}, headers=auth("carol"))
        clock.now += 30
        limited = await c.post("/v1/completions", json=BODY, headers=auth("carol"))
        other = await c.post("/v1/completions", json=BODY, headers=auth("dave"))
        clock.now += 31
        again = await c.post("/v1/completions", json=BODY, headers=auth("carol"))
        return first, limited, other, again, await c.get("/metrics")

    first, limited, other, again, metrics = call(app, requests)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] == 20
    err = assert_429(limited, "tokens", "tokens per minute")
    assert "Limit 20, Used 20" in err["message"] and limited.headers["retry-after"] == "30"
    assert limited.headers["x-ratelimit-remaining-tokens"] == "0"
    assert other.status_code == 200 and again.status_code == 200
    m = parse_metrics(metrics.text)
    assert m['leanserve:tenant_prompt_tokens_total{model_name="fake",tenant="carol"}'] == 4
    assert m['leanserve:tenant_generation_tokens_total{model_name="fake",tenant="carol"}'] == 18 + 3
    assert registry.num_tracked == 0


def test_keys_never_reach_the_logs(setup, caplog):
    app, _, _ = setup
    caplog.set_level(logging.DEBUG)

    async def requests(c):
        for _ in range(4):
            await c.post("/v1/completions", json=BODY, headers=auth("alice"))
        await c.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer sk-wrong-key-4242"})

    call(app, requests)
    assert "tenant alice: 429" in caplog.text
    assert all(k not in caplog.text for k in [*KEYS.values(), "sk-wrong-key-4242"])
    assert KEYS["alice"] not in repr(app.state.tenants.by_name["alice"])


# --------------------------------------------------------------------------------------------- configuration
def serve_config(*argv: str) -> ServerConfig:
    return config_from_args(ServerConfig, build_parser().parse_args(["serve", *argv]))


def test_repeated_api_key_flags_are_tenants():
    assert serve_config().api_keys == [] and TenantRegistry.from_config([], None, TenantLimits()) is None
    one = serve_config("--api-key", "k1")
    assert one.api_keys == ["k1"]
    assert [t.name for t in TenantRegistry.from_config(one.api_keys, None, TenantLimits()).tenants] == ["default"]
    sc = serve_config("--api-key", "k1", "--api-key", "k2", "--tenant-requests-per-minute", "5")
    limits = TenantLimits(sc.tenant_max_concurrent, sc.tenant_requests_per_minute, sc.tenant_tokens_per_minute)
    reg = TenantRegistry.from_config(sc.api_keys, None, limits)
    assert [(t.name, t.limits.requests_per_minute) for t in reg.tenants] == [("key-1", 5), ("key-2", 5)]
    assert reg.authenticate("Bearer k2").name == "key-2"
    assert ServerConfig(api_key="solo").api_keys == ["solo"]  # the Python API's single key still works
    with pytest.raises(InvalidParameterError):
        ServerConfig(api_key=["ok", " "])


def test_api_keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "team-a", "key": "sk-a", "requests_per_minute": 10},
        {"name": "team-b", "key": "sk-b", "max_concurrent": 2, "tokens_per_minute": 1000}]}))
    sc = serve_config("--api-keys-file", str(path), "--tenant-max-concurrent", "4", "--api-key", "sk-c")
    defaults = TenantLimits(sc.tenant_max_concurrent, sc.tenant_requests_per_minute, sc.tenant_tokens_per_minute)
    reg = TenantRegistry.from_config(sc.api_keys, sc.api_keys_file, defaults)
    assert [(t.name, t.limits) for t in reg.tenants] == [
        ("team-a", TenantLimits(4, 10, None)), ("team-b", TenantLimits(2, None, 1000)),
        ("default", TenantLimits(4, None, None))]
    assert reg.authenticate("Bearer sk-b").name == "team-b"


@pytest.mark.parametrize(("entries", "message"), [
    ([{"name": "a", "key": "sk-secret-1"}, {"name": "a", "key": "sk-secret-2"}], "used twice"),
    ([{"name": "a", "key": "sk-secret-1"}, {"name": "b", "key": "sk-secret-1"}], "shares its key"),
    ([{"name": "a b", "key": "sk-secret-1"}], "name must be"),
    ([{"name": "a", "key": ""}], "key must be"),
    ([{"name": "a", "key": "sk-secret-1", "rpm": 3}], "unknown field 'rpm'"),
    ([{"name": "a", "key": "sk-secret-1", "max_concurrent": 0}], "max_concurrent must be"),
    ([], "non-empty"),
])
def test_bad_keys_file_names_the_entry_never_the_key(tmp_path, entries, message):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(InvalidParameterError) as info:
        TenantRegistry.from_config([], str(path), TenantLimits())
    assert message in str(info.value) and "sk-secret" not in str(info.value)
    assert info.value.param == "api_keys_file"


def test_unreadable_keys_file(tmp_path):
    with pytest.raises(InvalidParameterError, match="cannot read"):
        load_keys_file(str(tmp_path / "missing.json"), TenantLimits())
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidParameterError, match="not valid JSON"):
        load_keys_file(str(tmp_path / "bad.json"), TenantLimits())
