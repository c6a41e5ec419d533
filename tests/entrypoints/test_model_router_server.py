"""Router models in a live server (``--model-router``, ``--model-routers-file``; entrypoints/openai/model_routing.py):
two models (the default file as ``cheap``, Q4_1 kernels, and again as ``strong``, ``quantization: none``), the
virtual ``auto`` (rules) and named routers: rules with a prompt-length limit, a cascade that keeps every answer
and one that escalates every answer. Each response names the model that answered and says why in
``usage.leanserve.route``; streamed cascades deliver the kept answer; the counters count routes and escalations."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import ServerProcess

ROUTERS = [
    {"name": "short-only", "policy": "rules", "cheap": "cheap", "strong": "strong", "max_cheap_prompt_tokens": 40},
    {"name": "cascade-keep", "policy": "cascade", "cheap": "cheap", "strong": "strong", "min_mean_logprob": -50},
    # a mean logprob is <= 0, and greedy answers of a 135M model are never all certain to float precision
    {"name": "cascade-up", "policy": "cascade", "cheap": "cheap", "strong": "strong", "min_mean_logprob": -1e-9},
]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    d = tmp_path_factory.mktemp("routing")
    (d / "models.json").write_text(json.dumps([{"served_model_name": "cheap"},
                                               {"served_model_name": "strong", "quantization": "none",
                                                "max_num_seqs": 4}]))
    (d / "routers.json").write_text(json.dumps(ROUTERS))
    srv = ServerProcess(["--models-config", str(d / "models.json"), "--kv-cache-memory", str(32 << 20),
                         "--max-model-len", "512", "--model-router", "rules",
                         "--model-routers-file", str(d / "routers.json")]).start()
    yield srv
    status = srv.stop()
    assert status == 0, f"server exit status {status}\n{srv.stderr()}"


def chat(srv: ServerProcess, model: str, content: str, **extra) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", headers=srv.headers, timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
        **extra})


def counter(srv: ServerProcess, name: str, **labels: str) -> float:
    key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"  # as exposed
    return srv.metrics().get(key, 0.0)


def test_router_models_are_listed(routed):
    cards = httpx.get(f"{routed.url}/v1/models", headers=routed.headers).json()["data"]
    assert [c["id"] for c in cards] == ["cheap", "strong", "auto", "short-only", "cascade-keep", "cascade-up"]
    assert {c["owned_by"] for c in cards[2:]} == {"leanserve-router"}
    assert routed.openai().models.retrieve("auto").id == "auto"
    r = httpx.post(f"{routed.url}/tokenize", headers=routed.headers, json={"model": "auto", "prompt": "Hi there"})
    assert r.status_code == 200 and r.json()["count"] > 0


def test_rules_route_by_content_and_length(routed):
    before = counter(routed, "leanserve:router_requests_total", router="auto", model_name="strong")
    plain = chat(routed, "auto", "Name a primary color.")
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["model"] == "cheap"
    assert body["usage"]["leanserve"]["route"] == {"router": "auto", "policy": "rules", "model": "cheap",
                                                   "reason": "rules: no rule matched", "score": None,
                                                   "escalated_from": None, "cheap_completion_tokens": None}
    code = chat(routed, "auto", "Fix this:\n```python\ndef f(x):\n    return x +\n```").json()
    assert code["model"] == "strong" and code["usage"]["leanserve"]["route"]["reason"].startswith("rules: code")
    assert counter(routed, "leanserve:router_requests_total", router="auto", model_name="strong") == before + 1
    # the same question, named: the routed answer is the named model's (greedy)
    named = chat(routed, "cheap", "Name a primary color.", cache=False).json()
    assert named["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]
    long = chat(routed, "short-only", "Tell me about colors. " * 12).json()
    assert long["model"] == "strong" and "> 40" in long["usage"]["leanserve"]["route"]["reason"]
    comp = httpx.post(f"{routed.url}/v1/completions", headers=routed.headers, json={
        "model": "short-only", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).json()
    assert comp["model"] == "cheap" and comp["usage"]["leanserve"]["route"]["router"] == "short-only"


def test_cascade_keeps_or_escalates(routed):
    up_before = counter(routed, "leanserve:router_escalations_total", router="cascade-up")
    kept = chat(routed, "cascade-keep", "Name a primary color.").json()
    route = kept["usage"]["leanserve"]["route"]
    assert kept["model"] == "cheap" and route["policy"] == "cascade" and route["escalated_from"] is None
    assert route["score"] is not None and route["score"] <= 0
    assert kept["choices"][0]["logprobs"] is None  # asked for by the cascade, not by the client
    up = chat(routed, "cascade-up", "Name a primary color.", logprobs=True).json()
    route = up["usage"]["leanserve"]["route"]
    assert up["model"] == "strong" and route["escalated_from"] == "cheap" and "escalated" in route["reason"]
    assert up["choices"][0]["logprobs"]["content"]  # the client asked: the strong answer's own
    assert counter(routed, "leanserve:router_escalations_total", router="cascade-up") == up_before + 1


def test_streamed_cascade_delivers_the_kept_answer(routed):
    whole = chat(routed, "cascade-keep", "Name a primary color.").json()
    stream = routed.openai().chat.completions.create(
        model="cascade-keep", messages=[{"role": "user", "content": "Name a primary color."}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole["choices"][0]["message"]["content"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole["choices"][0]["finish_reason"]
    assert chunks[-1].usage.completion_tokens == whole["usage"]["completion_tokens"]
    assert {c.model for c in chunks} == {"cheap"}


def test_bad_requests_to_a_router_are_400s_and_unknown_models_404(routed):
    r = chat(routed, "cascade-keep", "Hi", max_tokens=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = chat(routed, "autox", "Hi")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert chat(routed, "auto", "Name a primary color.").status_code == 200


def completion(srv: ServerProcess, model: str, **body) -> dict:
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=120,
                   json={"model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                         **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_cascade_judges_the_answer_not_an_echoed_prompt(routed):
    plain = completion(routed, "cascade-keep")["usage"]["leanserve"]["route"]["score"]
    echoed = completion(routed, "cascade-keep", echo=True)
    assert echoed["usage"]["leanserve"]["route"]["score"] == pytest.approx(plain, abs=1e-6)
    assert echoed["choices"][0]["text"].startswith("The capital of France is")
    # an echo of the prompt alone has no answer to judge: kept, not escalated
    up_before = counter(routed, "leanserve:router_escalations_total", router="cascade-up")
    only = completion(routed, "cascade-up", echo=True, max_tokens=0)
    assert only["model"] == "cheap" and "nothing to judge" in only["usage"]["leanserve"]["route"]["reason"]
    assert counter(routed, "leanserve:router_escalations_total", router="cascade-up") == up_before
    up = chat(routed, "cascade-up", "Name a primary color.").json()["usage"]["leanserve"]["route"]
    assert up["cheap_completion_tokens"] is not None and up["cheap_completion_tokens"] > 0
