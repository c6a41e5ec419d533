"""Hostile bodies on the shared server: nesting, size, list lengths, numbers and text no model can take. Each gets
a 4xx OpenAI envelope that names the limit, and the server stays healthy (checked after every test)."""

from __future__ import annotations

from leanserve.entrypoints.openai.limits import RequestLimits

import httpx
import pytest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]
LIMITS = RequestLimits()  # what `leanserve serve` uses (the body size is --max-request-bytes, 8 MiB by default)


def envelope(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def nested(depth: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": "Hi"}], "x": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [LIMITS.max_json_depth, 900, 100_000])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize"])
def test_deep_nesting_is_a_400_naming_the_limit(server, client, path, depth):
    r = client.post(path, content=nested(depth), headers={"Content-Type": "application/json"})
    err = envelope(r, 400, None, "json_too_deep")
    assert f"limit of {LIMITS.max_json_depth} levels" in err["message"]


def test_nesting_within_the_limit_is_served(server, client):
    # {"messages": [...], "x": [[...]]}: the object, then depth - 1 arrays (unknown fields are ignored)
    depth = LIMITS.max_json_depth - 1
    body = nested(depth)[:-1] + b', "max_tokens": 1}'
    r = client.post(CHAT, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_body_over_the_size_limit_is_a_413(server, client):
    big = b'{"prompt": "' + b"a" * (LIMITS.max_request_bytes + 10) + b'"}'
    r = client.post(COMPLETIONS, content=big, headers={"Content-Type": "application/json"})
    err = envelope(r, 413, None, "request_too_large")
    assert str(LIMITS.max_request_bytes) in err["message"]


def test_chunked_body_over_the_size_limit_is_a_413(server, client):
    """No Content-Length: the body is counted while it is read."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(LIMITS.max_request_bytes // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = client.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    err = envelope(r, 413, None, "request_too_large")
    assert str(LIMITS.max_request_bytes) in err["message"]


@pytest.mark.parametrize(("path", "field", "items", "limit"), [
    (CHAT, "stop", ["x"] * (LIMITS.max_stop + 1), LIMITS.max_stop),
    (COMPLETIONS, "stop", ["x"] * (LIMITS.max_stop + 1), LIMITS.max_stop),
    (CHAT, "stop_token_ids", [5] * (LIMITS.max_stop_token_ids + 1), LIMITS.max_stop_token_ids),
    (CHAT, "messages", MSGS * (LIMITS.max_messages + 1), LIMITS.max_messages),
    ("/tokenize", "messages", MSGS * (LIMITS.max_messages + 1), LIMITS.max_messages),
    (CHAT, "tools", [{"type": "function"}] * (LIMITS.max_tools + 1), LIMITS.max_tools),
    (COMPLETIONS, "prompt", ["Hi"] * (LIMITS.max_prompts + 1), LIMITS.max_prompts),
    (COMPLETIONS, "prompt", [[1, 2]] * (LIMITS.max_prompts + 1), LIMITS.max_prompts),
    ("/detokenize", "tokens", [1] * (LIMITS.max_token_ids + 1), LIMITS.max_token_ids),
])
def test_list_over_its_limit_is_a_400_naming_it(server, client, path, field, items, limit):
    body = {"messages": MSGS} if path == CHAT else {"prompt": "Hi"} if path == COMPLETIONS else {}
    r = client.post(path, json={**body, field: items})
    err = envelope(r, 400, field, "too_many_items")
    assert f"at most {limit} " in err["message"] and f"got {limit + 1}" in err["message"]


def test_lists_at_their_limit_pass_the_bound(server, client):
    r = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, "stop": ["zq"] * LIMITS.max_stop})
    assert r.status_code == 200, r.text
    r = client.post(COMPLETIONS, json={"prompt": [[1, 2]] * 3, "max_tokens": 1})  # a batch within the bound
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_integer_too_long_for_python_is_a_400(server, client):
    r = client.post(COMPLETIONS, content=b'{"prompt": "Hi", "n": ' + b"9" * 5000 + b"}",
                    headers={"Content-Type": "application/json"})
    err = envelope(r, 400, None)
    assert err["message"].startswith("the body is not valid JSON")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize"])
def test_lone_surrogate_is_a_400(server, client, path):
    text = b'"\\ud800 and more"'
    body = (b'{"messages": [{"role": "user", "content": ' + text + b"}]}" if path == CHAT
            else b'{"prompt": ' + text + b"}")
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    envelope(r, 400, None, "invalid_unicode")
    # a surrogate pair is one character, served as usual
    ok = client.post(COMPLETIONS, content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
                     headers={"Content-Type": "application/json"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_numbers_are_refused_by_the_field(server, client, value):
    r = client.post(CHAT, content=b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": ' + value + b"}",
                    headers={"Content-Type": "application/json"})
    err = envelope(r, 400, "temperature")
    assert err["message"].startswith("temperature must be finite"), err
    assert client.post(CHAT, json={"messages": MSGS, "max_tokens": 1}).status_code == 200  # still serving


def test_existing_messages_are_unchanged(server, client):
    """The limits come on top: the messages of the checks that were there before stay as they were."""
    r = client.post(CHAT, content=b"this is not json", headers={"Content-Type": "application/json"})
    assert envelope(r, 400)["message"].startswith("the body is not valid JSON: ")
    r = client.post(CHAT, content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert envelope(r, 400)["message"] == "the body must be a JSON object"
    r = client.post(CHAT, json={"messages": MSGS, "tools": [{"type": "function"}]})
    assert envelope(r, 400, "tools")["message"] == "tools.0.function: Field required"


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-46])
def test_top_p_below_float32_range_keeps_the_most_likely_token(server, client, top_p):
    """Found by the fuzzer: such a top_p rounded to 0 in the sampler, which kept no token and failed the step."""
    body = {"messages": MSGS, "max_tokens": 6, "ignore_eos": True}
    r = client.post(CHAT, json={**body, "top_p": top_p})
    assert r.status_code == 200, r.text
    greedy = client.post(CHAT, json={**body, "temperature": 0}).json()
    assert r.json()["choices"][0]["message"] == greedy["choices"][0]["message"]
