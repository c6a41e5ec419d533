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
                                                   "escalated_from": None, "cheap_completion_tokens": None,
                                                   "cheap_history_summary": None}
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


def sse_chunks(srv: ServerProcess, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{srv.url}{path}", headers=srv.headers, timeout=120, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a primary color."}]}),
    ("/v1/completions", {"prompt": ["The capital of France is", "One, two,"]}),
])
def test_a_kept_streamed_cascade_has_timings_like_other_streams(routed, path, body):
    """As a named model's stream: ``timings`` (the same keys) on the last chunk that carries a choice, only there;
    the finish chunks carry ``stop_reason``."""
    body = {**body, "model": "cascade-keep", "max_tokens": 6, "temperature": 0, "cache": False}
    kept = sse_chunks(routed, path, body)
    named = sse_chunks(routed, path, {**body, "model": "cheap"})
    for chunks in (kept, named):
        with_choice = [i for i, c in enumerate(chunks) if c["choices"]]
        timed = [i for i, c in enumerate(chunks) if c.get("timings")]
        assert timed == [with_choice[-1]], chunks
        finishes = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert finishes and all("stop_reason" in ch for ch in finishes)
    assert set(kept[with_choice_last(kept)]["timings"]) == set(named[with_choice_last(named)]["timings"])
    timings = kept[with_choice_last(kept)]["timings"]
    # the client's first byte comes after the whole cheap answer is generated and judged: its TTFT, not the
    # internal answer's first token
    assert timings["ttft_ms"] >= timings["e2e_ms"] > timings["ttft_ms"] - 10_000 and timings["decode_ms"] > 0
    assert {c["model"] for c in kept} == {"cheap"}


def with_choice_last(chunks: list[dict]) -> int:
    return [i for i, c in enumerate(chunks) if c["choices"]][-1]


PLAIN, MATH = "Name a primary color.", "Compute (17 * 4) - 9 + 23."


def test_a_batch_of_prompts_is_judged_per_prompt(routed):
    """Each prompt of a completion batch is judged; one model serves the batch: the strong one when any prompt
    goes there (text prompts and token-id prompts alike)."""
    both = completion(routed, "auto", prompt=[PLAIN, MATH], max_tokens=2)
    route = both["usage"]["leanserve"]["route"]
    assert both["model"] == "strong" and len(both["choices"]) == 2
    assert route["reason"].startswith("batch of 2 prompts, 1 to strong; prompt 1: rules: math in prompt")
    plain = completion(routed, "auto", prompt=[PLAIN, "Name a fruit."], max_tokens=2)
    assert plain["model"] == "cheap"
    assert plain["usage"]["leanserve"]["route"]["reason"] == "batch of 2 prompts, 0 to strong; prompt 0: rules: " \
        "no rule matched"
    ids = [httpx.post(f"{routed.url}/tokenize", headers=routed.headers, json={"model": "cheap", "prompt": p,
                                                                              "add_special_tokens": False}
                      ).json()["tokens"] for p in (MATH, PLAIN)]
    tokens = completion(routed, "auto", prompt=ids, max_tokens=2)
    assert tokens["model"] == "strong" and "prompt 0: rules: math" in tokens["usage"]["leanserve"]["route"]["reason"]
    assert completion(routed, "auto", prompt=[PLAIN], max_tokens=2)["usage"]["leanserve"]["route"]["reason"] == \
        "rules: no rule matched"  # one prompt in a list: no batch


def test_a_cascade_judges_every_prompt_of_a_batch(routed):
    a, b = "The capital of France is", "One, two,"
    scores = [completion(routed, "cascade-keep", prompt=p)["usage"]["leanserve"]["route"]["score"] for p in (a, b)]
    batch = completion(routed, "cascade-keep", prompt=[a, b])
    route = batch["usage"]["leanserve"]["route"]
    assert batch["model"] == "cheap" and route["score"] == pytest.approx(min(scores), abs=1e-6)
    assert route["reason"].startswith(f"batch of 2 prompts; least sure, prompt {scores.index(min(scores))}: cascade")
    up = completion(routed, "cascade-up", prompt=[a, b])
    assert up["model"] == "strong" and up["usage"]["leanserve"]["route"]["reason"].startswith(
        "batch of 2 prompts; prompt 0: cascade: mean logprob")
    assert len(up["choices"]) == 2


def test_an_escalated_cascade_reports_the_cheap_models_history_summary(routed):
    """With history_summary_tokens each model summarizes the turns its context drops with itself: the strong
    model's summary is usage.leanserve.history_summary, the cheap one's route.cheap_history_summary."""
    turns = []
    for i in range(8):  # about 330 tokens: within both models' 512, over max_prompt_tokens
        turns += [{"role": "user", "content": f"Tell me fact number {i} about the sea and its tides."},
                  {"role": "assistant", "content": f"Fact {i}: the sea covers much of the planet and moves daily."}]
    messages = [{"role": "system", "content": "You are brief."}, *turns,
                {"role": "user", "content": "Name a primary color."}]
    r = httpx.post(f"{routed.url}/v1/chat/completions", headers=routed.headers, timeout=300, json={
        "model": "cascade-up", "messages": messages, "max_tokens": 4, "temperature": 0, "cache": False,
        "max_prompt_tokens": 200, "history_summary_tokens": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    route, strong_summary = body["usage"]["leanserve"]["route"], body["usage"]["leanserve"]["history_summary"]
    assert body["model"] == "strong" and route["escalated_from"] == "cheap", route
    cheap_summary = route["cheap_history_summary"]
    assert cheap_summary["status"] == "computed" and strong_summary["status"] == "computed"
    assert cheap_summary["prompt_tokens"] > 0 and 1 <= cheap_summary["completion_tokens"] <= 8
    assert cheap_summary["replaces"] and strong_summary["replaces"]


def test_a_huge_prompt_to_a_router_does_not_stall_the_server(routed):
    """Issue 18: a long digit run froze the server for seconds in the rules detectors (12 KB: 12 s). The detectors
    read a bounded window in linear time and the decision runs off the event loop: /health answers meanwhile and
    the request gets its 400 (too long) fast."""
    import threading
    import time

    results: dict[str, httpx.Response] = {}

    def send(key: str, path: str, body: dict) -> None:
        results[key] = httpx.post(f"{routed.url}{path}", headers=routed.headers, timeout=120, json=body)

    threads = [threading.Thread(target=send, args=("digits", "/v1/completions",
                                                   {"model": "auto", "prompt": "1" * 50_000, "max_tokens": 1})),
               threading.Thread(target=send, args=("newlines", "/v1/chat/completions", {
                   "model": "auto", "messages": [{"role": "user", "content": "hi" + "\n" * 50_000}],
                   "max_tokens": 1}))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in threads) and time.perf_counter() - start < 60:
        t0 = time.perf_counter()
        assert httpx.get(f"{routed.url}/health", timeout=30).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.02)
    for t in threads:
        t.join(60)
    assert worst < 1.0, worst
    for key in ("digits", "newlines"):
        r = results[key]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("model", ["auto", "cascade-keep"])
def test_bad_token_ids_to_a_router_are_400s_as_for_a_named_model(routed, model):
    named = httpx.post(f"{routed.url}/v1/completions", headers=routed.headers, timeout=60,
                       json={"model": "cheap", "prompt": [-1], "max_tokens": 1})
    for prompt in ([-1], [[5, 6], [10**9]]):
        r = httpx.post(f"{routed.url}/v1/completions", headers=routed.headers, timeout=60,
                       json={"model": model, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt"
        assert r.json()["error"]["message"] == named.json()["error"]["message"]
        assert r.json()["error"]["message"].startswith("prompt token ids must be integers in [0, ")
    # ids the models share (one GGUF file) pass as today
    ok = completion(routed, "auto", prompt=[504, 3575, 282], max_tokens=2)
    assert ok["model"] == "cheap" and ok["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_cascade_escalates_an_answer_a_stop_string_emptied(routed, stream):
    """The text the client would get is judged: a stop string at the answer's start leaves it empty, and an
    empty answer is answered again by the strong model (streamed the same)."""
    body = {"messages": [{"role": "user", "content": PLAIN}], "max_tokens": 8, "temperature": 0, "cache": False}
    first = httpx.post(f"{routed.url}/v1/chat/completions", headers=routed.headers, timeout=120,
                       json={**body, "model": "cheap"}).json()["choices"][0]["message"]["content"]
    assert first.strip()
    body = {**body, "model": "cascade-keep", "stop": [first[:2]]}
    if stream:
        chunks = sse_chunks(routed, "/v1/chat/completions", body)
        assert {c["model"] for c in chunks} == {"strong"}
        assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == ""
        return
    r = httpx.post(f"{routed.url}/v1/chat/completions", headers=routed.headers, timeout=120, json=body).json()
    assert r["model"] == "strong" and r["choices"][0]["message"]["content"] == ""
    route = r["usage"]["leanserve"]["route"]
    assert route["escalated_from"] == "cheap" and "empty cheap answer" in route["reason"]
