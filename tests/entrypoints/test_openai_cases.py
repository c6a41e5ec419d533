"""The cases of ../shared/cases/openai-api.md, one test (or a few) each, against the live server."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import sse_chunks


def post_stream(client: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, list[dict]]:
    with client.stream("POST", path, json=body) as r:
        raw = r.read().decode()
    assert r.status_code == 200, raw
    return r, sse_chunks(raw)


def chat_body(server, content: str, **kw) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": content}], **kw}


def assert_error(r: httpx.Response, status: int, param: str | None = "__any__", code: str | None = "__any__") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param != "__any__":
        assert err["param"] == param, err
    if code != "__any__":
        assert err["code"] == code, err
    return err


def check_choice_stream(chunks: list[dict], index: int) -> tuple[str, str]:
    """Content of one choice and its finish reason; checks there is exactly one, with an empty delta, and that
    nothing follows it."""
    text, reason = "", None
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] != index:
                continue
            assert "finish_reason" in ch
            if reason is not None:
                raise AssertionError(f"choice {index}: chunk after finish_reason {reason}: {ch}")
            if ch["finish_reason"] is not None:
                reason = ch["finish_reason"]
                assert ch["delta"] == {}, ch
            else:
                text += ch["delta"].get("content") or ""
    assert reason in ("stop", "length", "abort"), reason
    return text, reason


# ------------------------------------------------------------------------------------------------------ case 1
def test_case1_chat_stream_wire_format(server, client):
    r, chunks = post_stream(client, "/v1/chat/completions",
                            chat_body(server, "Say hi", max_tokens=5, stream=True))
    assert r.headers["content-type"].startswith("text/event-stream")
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    assert chunks[0]["model"] == server.model
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c.get("usage") is None for c in chunks)  # no include_usage: no usage anywhere
    assert all(c["choices"] for c in chunks)  # ... and no usage chunk
    text, reason = check_choice_stream(chunks, 0)
    assert reason == "length" or (reason == "stop" and len(text) > 0)


# ------------------------------------------------------------------------------------------------------ case 2
@pytest.mark.parametrize("logprobs", [False, True])
def test_case2_usage_while_streaming(server, client, logprobs):
    body = chat_body(server, "Write a haiku", n=2, max_tokens=8, stream=True,
                     stream_options={"include_usage": True})
    if logprobs:  # makes the streamed tokens countable exactly: one logprob entry per token
        body["logprobs"] = True
    _, chunks = post_stream(client, "/v1/chat/completions", body)
    usage_chunks = [c for c in chunks if c["choices"] == []]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    plain = client.post("/v1/chat/completions", json=chat_body(server, "Write a haiku", max_tokens=1)).json()
    assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    reasons = [check_choice_stream(chunks, i)[1] for i in (0, 1)]
    if logprobs:
        streamed = sum(len(ch["logprobs"]["content"]) for c in chunks for ch in c["choices"]
                       if ch.get("logprobs"))
        assert usage["completion_tokens"] == streamed
    if reasons == ["length", "length"]:
        assert usage["completion_tokens"] == 16
    assert usage["completion_tokens"] <= 16


# ------------------------------------------------------------------------------------------------------ case 3
def test_case3_several_choices(server, client):
    body = chat_body(server, "Count to three", n=3, max_tokens=4, temperature=1.0, seed=1234)
    _, chunks = post_stream(client, "/v1/chat/completions", {**body, "stream": True})
    assert {ch["index"] for c in chunks for ch in c["choices"]} == {0, 1, 2}
    streamed = {i: check_choice_stream(chunks, i) for i in range(3)}
    whole = client.post("/v1/chat/completions", json=body).json()
    assert [ch["index"] for ch in whole["choices"]] == [0, 1, 2]
    for ch in whole["choices"]:  # same seed: the same choices, streamed or not
        assert streamed[ch["index"]] == (ch["message"]["content"], ch["finish_reason"])


# ------------------------------------------------------------------------------------------------------ case 4
def test_case4_stop_strings_completions(server, client):
    base = {"model": server.model, "prompt": "1, 2, 3,", "temperature": 0, "max_tokens": 20}
    free = client.post("/v1/completions", json={**base, "max_tokens": 6}).json()["choices"][0]["text"]
    assert free.startswith(" 4, 5"), f"the model does not continue the count: {free!r}"
    r = client.post("/v1/completions", json={**base, "stop": [" 5"]}).json()["choices"][0]
    assert (r["text"], r["finish_reason"]) == (" 4,", "stop")
    r = client.post("/v1/completions", json={**base, "stop": [" 5"], "include_stop_str_in_output": True})
    assert (r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]) == (" 4, 5", "stop")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_case4_empty_stop_string_is_rejected(server, client, path):
    body = ({"model": server.model, "prompt": "Hello", "max_tokens": 5} if "chat" not in path
            else chat_body(server, "Hello", max_tokens=5))
    assert_error(client.post(path, json={**body, "stop": [""]}), 400, "stop")


def test_case4_stop_at_first_token(server, client):
    base = {"model": server.model, "prompt": "The capital of France is", "temperature": 0}
    first = client.post("/v1/completions", json={**base, "max_tokens": 1, "logprobs": 0}).json()
    token = first["choices"][0]["logprobs"]["tokens"][0]
    assert token.strip(), f"first token {token!r} is blank"
    r = client.post("/v1/completions", json={**base, "max_tokens": 10, "stop": [token]}).json()["choices"][0]
    assert (r["text"], r["finish_reason"]) == ("", "stop")
    chat = chat_body(server, "What is the capital of France?", temperature=0)
    first = client.post("/v1/chat/completions", json={**chat, "max_tokens": 1}).json()["choices"][0]
    r = client.post("/v1/chat/completions", json={**chat, "max_tokens": 10, "stop": [first["message"]["content"]]})
    assert (r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]) == ("", "stop")


def test_case4_chat_output_has_no_end_of_turn_text(server, client):
    body = chat_body(server, "Say hi", temperature=0, max_tokens=60)
    r = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert r["finish_reason"] == "stop", r  # the model ended its turn
    assert "<|im_end|>" not in r["message"]["content"] and "<|im_start|>" not in r["message"]["content"]
    _, chunks = post_stream(client, "/v1/chat/completions", {**body, "stream": True})
    text, reason = check_choice_stream(chunks, 0)
    assert (text, reason) == (r["message"]["content"], "stop")


# ------------------------------------------------------------------------------------------------------ case 5
def chat_prompt_of_length(server, client, n: int) -> list[dict]:
    """Messages whose rendered chat prompt is exactly ``n`` tokens."""
    def count(msgs):
        return client.post("/tokenize", json={"model": server.model, "messages": msgs}).json()["count"]

    overhead = count([{"role": "user", "content": ""}])
    msgs = [{"role": "user", "content": " hi" * (n - overhead)}]
    assert count(msgs) == n
    return msgs


def test_case5_prompt_longer_than_context(server, client):
    c = server.max_model_len
    msgs = chat_prompt_of_length(server, client, c + 10)
    err = assert_error(client.post("/v1/chat/completions", json={"model": server.model, "messages": msgs}),
                       400, code="context_length_exceeded")
    assert str(c + 10) in err["message"] and str(c) in err["message"] and err["param"] == "messages"
    err = assert_error(client.post("/v1/completions", json={"model": server.model, "prompt": [30] * (c + 10)}),
                       400, code="context_length_exceeded")
    assert str(c + 10) in err["message"] and str(c) in err["message"] and err["param"] == "prompt"
    assert server.healthy()
    ok = client.post("/v1/chat/completions", json=chat_body(server, "Hi", max_tokens=2))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_case5_prompt_plus_max_tokens_longer_than_context(server, client):
    c = server.max_model_len
    msgs = chat_prompt_of_length(server, client, c - 10)
    r = client.post("/v1/chat/completions", json={"model": server.model, "messages": msgs, "max_tokens": 100})
    err = assert_error(r, 400, code="context_length_exceeded")
    assert str(c) in err["message"] and str(c - 10) in err["message"] and "100" in err["message"]
    r = client.post("/v1/completions", json={"model": server.model, "prompt": [30] * (c - 10), "max_tokens": 100})
    err = assert_error(r, 400, code="context_length_exceeded")
    assert str(c) in err["message"] and str(c + 90) in err["message"]


def test_case5_chat_without_max_tokens_fills_the_context(server, client):
    c = server.max_model_len
    msgs = chat_prompt_of_length(server, client, c - 24)
    r = client.post("/v1/chat/completions", json={"model": server.model, "messages": msgs, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 24 and body["usage"]["total_tokens"] == c


def test_case5_chat_without_max_tokens_stops_with_the_model(server, client):
    # min_tokens 20 would be refused with a default of 16: this proves there is no such default.
    body = chat_body(server, "What is 2 + 2? Answer with one short sentence.", temperature=0, min_tokens=20)
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["usage"]["completion_tokens"] >= 20
    assert r["choices"][0]["finish_reason"] in ("stop", "length")


def test_case5_completions_default_max_tokens_is_16(server, client):
    r = client.post("/v1/completions", json={"model": server.model, "prompt": "Once upon a time", "ignore_eos": True})
    body = r.json()
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("max_tokens", [0, -1])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_case5_nonpositive_max_tokens(server, client, path, max_tokens):
    body = ({"model": server.model, "prompt": "Hello"} if "chat" not in path else chat_body(server, "Hello"))
    assert_error(client.post(path, json={**body, "max_tokens": max_tokens}), 400, "max_tokens")


def test_case5_echo_with_zero_max_tokens_returns_the_prompt(server, client):
    r = client.post("/v1/completions", json={"model": server.model, "prompt": "Hello world", "echo": True,
                                             "max_tokens": 0}).json()
    assert r["choices"][0]["text"] == "Hello world" and r["usage"]["completion_tokens"] == 0


# ------------------------------------------------------------------------------------------------------ case 6
def test_case6_chat_logprobs(server, client):
    body = chat_body(server, "Shanghai is", logprobs=True, top_logprobs=5, max_tokens=20, temperature=0)
    r = client.post("/v1/chat/completions", json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    joined = b""
    for entry in content:
        raw = bytes(entry["bytes"])
        joined += raw
        assert entry["token"] == raw.decode("utf-8", errors="replace")
        assert entry["logprob"] <= 0
        tops = entry["top_logprobs"]
        assert len(tops) == 5
        lps = [t["logprob"] for t in tops]
        assert lps == sorted(lps, reverse=True)
        assert (tops[0]["token"], tops[0]["logprob"]) == (entry["token"], entry["logprob"])
        assert all(t["token"] == bytes(t["bytes"]).decode("utf-8", errors="replace") for t in tops)
    if r["choices"][0]["finish_reason"] == "length":
        assert joined.decode("utf-8", errors="replace") == r["choices"][0]["message"]["content"]

    # Streaming: each chunk's logprobs are the tokens of that chunk, one to one.
    _, chunks = post_stream(client, "/v1/chat/completions", {**body, "stream": True})
    streamed = []
    for c in chunks:
        for ch in c["choices"]:
            if ch["finish_reason"] is None and "content" in ch["delta"] and ch.get("logprobs"):
                toks = ch["logprobs"]["content"]
                assert "".join(t["token"] for t in toks) == ch["delta"]["content"]
                streamed += toks
    assert [t["token"] for t in streamed] == [t["token"] for t in content]
    # (the prompt is served from the prefix cache the second time: equal up to float rounding)
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-3 for a, b in zip(streamed, content, strict=True))


def test_case6_logprobs_without_top_logprobs(server, client):
    body = chat_body(server, "Shanghai is", logprobs=True, max_tokens=5, temperature=0)
    r = client.post("/v1/chat/completions", json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert all(e["top_logprobs"] == [] for e in content)


def test_case6_bad_top_logprobs(server, client):
    body = chat_body(server, "Shanghai is", max_tokens=5)
    assert_error(client.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 21}),
                 400, "top_logprobs")
    assert_error(client.post("/v1/chat/completions", json={**body, "top_logprobs": 2}), 400, "top_logprobs")
    assert_error(client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": 2}),
                 400, "top_logprobs")


# ------------------------------------------------------------------------------------------------------ case 7
def test_case7_unknown_model(server, client):
    r = client.post("/v1/chat/completions", json={**chat_body(server, "Hi"), "model": "no-such-model"})
    assert_error(r, 404, "model")


def test_case7_unknown_field_is_ignored(server, client):
    r = client.post("/v1/chat/completions", json=chat_body(server, "Hi", max_tokens=2, foo_unknown=1))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content", [b"this is not json", b'{"model": "x", ', b"", b"[1, 2]"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_case7_body_not_json(server, client, path, content):
    r = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert_error(r, 400)


def test_case7_messages_missing(server, client):
    assert_error(client.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2}), 400,
                 "messages")


def test_case7_models(server, client):
    r = client.get("/v1/models").json()
    assert r["object"] == "list"
    assert [(m["id"], m["object"]) for m in r["data"]] == [(server.model, "model")]


# ------------------------------------------------------------------------------------------------------ case 8
def test_case8_prefix_cache_in_usage(server, client):
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()
    text = "Repeat after me: " + " ".join(words[i % len(words)] + str(i) for i in range(46))
    body = chat_body(server, text, temperature=0, max_tokens=6)
    first = client.post("/v1/chat/completions", json=body).json()
    second = client.post("/v1/chat/completions", json=body).json()
    assert 180 <= first["usage"]["prompt_tokens"] <= 230
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"] and cached % 16 == 0
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < cached
