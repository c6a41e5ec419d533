"""Prompt logprobs over HTTP, as vLLM returns them: ``/v1/completions`` with ``echo`` + ``logprobs`` (OpenAI's legacy
format, the prompt's tokens first, the first one ``null``), ``max_tokens: 0`` with echo (the prompt alone), vLLM's
``prompt_logprobs`` on both endpoints; the values are the engine's (an in-process engine on the same settings gives
the same bits) and do not depend on the prefix cache."""

from __future__ import annotations

import json

from leanserve import LLM, SamplingParams
from leanserve.loader import load_model

import pytest

PROMPT = "The quick brown fox jumps over the lazy dog because it was"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine():
    """An in-process engine with the server's defaults (native 4-bit weights)."""
    return LLM(loaded=load_model(None, quantization="auto"), kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def ids(engine):
    return engine.get_tokenizer().encode(PROMPT)


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_returns_the_prompt_then_the_completion(server, client, engine, ids):
    body = {"model": server.model, "prompt": ids, "temperature": 0, "max_tokens": 3, "logprobs": 2, "echo": True}
    out = post(client, COMPLETIONS, body)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    p = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == p + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"],
                                                  strict=False))
    assert "".join(lp["tokens"][:p]) == PROMPT and choice["text"].startswith(PROMPT)
    ref = engine.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                                    prompt_logprobs=2), use_tqdm=False)[0]
    for i in range(1, p):
        assert lp["token_logprobs"][i] == ref.prompt_logprobs[i][ids[i]].logprob  # the engine's bits
        top = lp["top_logprobs"][i]
        assert 2 <= len(top) <= 3 and top[lp["tokens"][i]] == lp["token_logprobs"][i]
        assert max(top.values()) == max(e.logprob for e in ref.prompt_logprobs[i].values())
    # the completion's part equals a request without echo
    plain = post(client, COMPLETIONS, {**body, "echo": False})["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    assert lp["token_logprobs"][p:] == plain["logprobs"]["token_logprobs"]
    assert lp["tokens"][p:] == plain["logprobs"]["tokens"]
    assert lp["text_offset"][p] == len("".join(lp["tokens"][:p]))
    # vLLM's field comes with it: the same values, keyed by token id, the prompt token first
    plp = choice["prompt_logprobs"]
    assert len(plp) == p and plp[0] is None
    for i in range(1, p):
        first_id, first = next(iter(plp[i].items()))
        assert int(first_id) == ids[i] and first["logprob"] == lp["token_logprobs"][i]
        assert first["rank"] >= 1 and first["decoded_token"] == lp["tokens"][i]
    # asked again (the prompt is in the prefix cache now): the same response
    again = post(client, COMPLETIONS, body)["choices"][0]
    assert again["logprobs"] == lp and again["prompt_logprobs"] == plp


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(server, client, ids):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 0, "logprobs": 1, "echo": True}
    out = post(client, COMPLETIONS, body)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 0
    longer = post(client, COMPLETIONS, {**body, "max_tokens": 2})["choices"][0]["logprobs"]
    assert longer["token_logprobs"][:len(ids)] == lp["token_logprobs"]
    # lm-eval's loglikelihood request: token ids in a batch, echo, logprobs 1, max_tokens 1
    batch = post(client, COMPLETIONS, {"model": server.model, "prompt": [ids, ids[:5]], "temperature": 0,
                                       "max_tokens": 1, "logprobs": 1, "echo": True, "seed": 1234})
    first, second = sorted(batch["choices"], key=lambda c: c["index"])
    assert first["logprobs"]["token_logprobs"][:len(ids)] == lp["token_logprobs"]
    # a shorter prompt is another computation (other GEMM and attention shapes): equal up to rounding
    assert second["logprobs"]["token_logprobs"][0] is None
    assert all(abs(a - b) < 1e-2 for a, b in zip(second["logprobs"]["token_logprobs"][1:5], lp["token_logprobs"][1:5],
                                                 strict=True))
    # streamed: the echo and its logprobs come first, then the finish
    with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [c for e in events for c in e["choices"]]
    assert streamed[0]["text"] == PROMPT and streamed[0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    assert streamed[-1]["finish_reason"] == "length"
    assert "".join(c["text"] for c in streamed) == PROMPT


def test_streamed_echo_with_logprobs_equals_the_whole_response(server, client):
    body = {"model": server.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 4, "logprobs": 1,
            "echo": True}
    whole = post(client, COMPLETIONS, body)["choices"][0]
    with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [c for e in events for c in e["choices"] if c["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in parts for x in c["logprobs"][key]] == whole["logprobs"][key], key
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["text"]


def test_prompt_logprobs_extension_on_both_endpoints(server, client, engine, ids):
    out = post(client, COMPLETIONS, {"model": server.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                     "prompt_logprobs": 3})
    choice = out["choices"][0]
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    assert all(3 <= len(e) <= 4 and sorted(x["rank"] for x in e.values())[:3] == [1, 2, 3] for e in plp[1:])
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = post(client, CHAT, {"model": server.model, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    tok = engine.get_tokenizer()
    chat_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    cplp = chat["prompt_logprobs"]
    assert len(cplp) == len(chat_ids) and cplp[0] is None
    assert [int(next(iter(e))) for e in cplp[1:]] == chat_ids[1:] and all(len(e) == 1 for e in cplp[1:])
    ref = engine.generate({"prompt_token_ids": chat_ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    assert [next(iter(e.values()))["logprob"] for e in cplp[1:]] == \
        [ref.prompt_logprobs[i][chat_ids[i]].logprob for i in range(1, len(chat_ids))]
    # without the field, no prompt logprobs (and null, as vLLM)
    plain = post(client, CHAT, {"model": server.model, "messages": messages, "max_tokens": 1})
    assert plain["prompt_logprobs"] is None
    # prompt_logprobs 0 with stream is allowed (vLLM's rule), and streams as usual
    with client.stream("POST", CHAT, json={"model": server.model, "messages": messages, "max_tokens": 2,
                                           "prompt_logprobs": 0, "stream": True}) as r:
        assert r.status_code == 200 and any(line == "data: [DONE]" for line in r.iter_lines())
