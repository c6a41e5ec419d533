"""Bad input never breaks the server: each gets a 4xx OpenAI error envelope and /health stays 200."""

from __future__ import annotations

import httpx
import pytest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]

# (path, body, expected status, expected param); "M" is replaced by the served model name.
BAD_INPUTS = [
    (CHAT, {"messages": MSGS, "temperature": -1}, 400, "temperature"),
    (CHAT, {"messages": MSGS, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": MSGS, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": MSGS, "n": 0}, 400, "n"),
    (CHAT, {"messages": MSGS, "n": "2"}, 400, "n"),
    (CHAT, {"messages": MSGS, "n": True}, 400, "n"),
    (CHAT, {"messages": MSGS, "max_tokens": 1.5}, 400, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "presence_penalty": 3}, 400, "presence_penalty"),
    (CHAT, {"messages": MSGS, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (CHAT, {"messages": MSGS, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CHAT, {"messages": MSGS, "top_k": -2}, 400, "top_k"),
    (CHAT, {"messages": MSGS, "min_p": 2}, 400, "min_p"),
    (CHAT, {"messages": MSGS, "seed": "x"}, 400, "seed"),
    (CHAT, {"messages": MSGS, "stop": 5}, 400, "stop"),
    (CHAT, {"messages": MSGS, "stop": ["a", ""]}, 400, "stop"),
    (CHAT, {"messages": MSGS, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (CHAT, {"messages": MSGS, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
    (CHAT, {"messages": MSGS, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": MSGS, "stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options"),
    (COMPLETIONS, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": MSGS, "logit_bias": {"50": 5}}, 400, "logit_bias"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     400, "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "system", "content": []}]}, 400, "messages"),
    (CHAT, {"messages": MSGS, "stop_token_ids": [10**8]}, 400, "stop_token_ids"),
    (CHAT, {"messages": MSGS, "model": 5}, 400, "model"),
    (COMPLETIONS, {"prompt": "Hi", "suffix": "end"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 21, "echo": True}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": "2"}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": True}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": 1, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSGS, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (CHAT, {"messages": MSGS, "prompt_logprobs": 2.5}, 400, "prompt_logprobs"),
    (CHAT, {"messages": MSGS, "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [-1]}, 400, "prompt"),
    (COMPLETIONS, {}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": "16"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "n": 1000}, 400, "n"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, *_rest) in enumerate(BAD_INPUTS)])
def test_bad_input(server, client, path, body, status, param):
    r = client.post(path, json={"model": server.model, **body} if "model" not in body else body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"]
    assert server.healthy()


@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_streaming_request_is_a_plain_400(server, client, stream):
    r = client.post(CHAT, json={"model": server.model, "messages": MSGS, "temperature": -1, "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_api_key(server):
    body = {"model": server.model, "messages": MSGS, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key},
                    {"Authorization": "Basic " + server.api_key}):
        r = httpx.post(f"{server.url}{CHAT}", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers=headers, timeout=60).status_code == 401
    # /health and /metrics stay open (probes and scrapers carry no key)
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=60).status_code == 200
    assert httpx.post(f"{server.url}{CHAT}", json=body, headers=server.headers, timeout=60).status_code == 200


def test_unknown_route_and_method_are_json(server, client):
    r = client.get("/v1/no-such-endpoint")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get(CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_unknown_model_on_every_endpoint(server, client):
    for path, body in ((COMPLETIONS, {"prompt": "Hi"}), (CHAT, {"messages": MSGS}), ("/tokenize", {"prompt": "a"})):
        r = client.post(path, json={"model": "no-such-model", **body})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_tokenize_detokenize(server, client):
    r = client.post("/tokenize", json={"model": server.model, "prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == server.max_model_len
    assert "".join(body["token_strs"]) == "Hello world"
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    chat = client.post("/tokenize", json={"messages": MSGS}).json()
    usage = client.post(CHAT, json={"messages": MSGS, "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]


NULL_IS_DEFAULT = {CHAT: ("logprobs", "n", "stream", "min_tokens", "ignore_eos", "include_stop_str_in_output",
                          "skip_special_tokens", "speculative", "priority", "add_generation_prompt",
                          "parallel_tool_calls", "reorder_documents"),
                   COMPLETIONS: ("echo", "n", "stream", "min_tokens", "speculative")}


def test_null_is_the_default(server, client):
    # OpenAI's API treats null as an omitted field: same answer as without it (greedy), not a 400
    for path, fields in NULL_IS_DEFAULT.items():
        body = {"messages": MSGS} if path == CHAT else {"prompt": "Hello"}
        body |= {"temperature": 0, "max_tokens": 4}
        want = client.post(path, json=body).json()["choices"][0]
        got = client.post(path, json=body | dict.fromkeys(fields)).json()["choices"][0]
        assert (got.get("message") or got.get("text")) == (want.get("message") or want.get("text"))
        assert got["logprobs"] is None and want["logprobs"] is None
