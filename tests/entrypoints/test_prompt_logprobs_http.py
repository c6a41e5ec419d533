"""Prompt logprobs over HTTP, as vLLM returns them: ``/v1/completions`` with ``echo`` + ``logprobs`` (OpenAI's legacy
format, the prompt's tokens first, the first one ``null``), ``max_tokens: 0`` with echo (the prompt alone), vLLM's
``prompt_logprobs`` on both endpoints; the values are the engine's (an in-process engine on the same settings gives
the same bits) and do not depend on the prefix cache."""

from __future__ import annotations

import json

from leanserve import LLM, SamplingParams
from leanserve.kernels import native_ops
from leanserve.loader import load_model
from leanserve.quantization.prefill_gemm import resolve_prefill_gemm

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
    # a shorter prompt is another computation (other GEMM and attention shapes): equal up to rounding; with the
    # default --prefill-gemm bf16 (AVX512_BF16 CPUs) a last-bit difference can flip a bf16 rounding of a prompt
    # row's activations, so "rounding" is bf16's (measured up to 0.3 nats against fp32: README "Prefill GEMMs"), and
    # with int8 (the default on AVX2 builds) an int8 rounding's (up to 0.65 nats)
    tol = {"bf16": 0.3, "int8": 1.0}.get(resolve_prefill_gemm("auto", native_ops()), 1e-2)
    assert second["logprobs"]["token_logprobs"][0] is None
    diffs = [abs(a - b) for a, b in zip(second["logprobs"]["token_logprobs"][1:5], lp["token_logprobs"][1:5],
                                        strict=True)]
    assert max(diffs) < tol, diffs
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


CONTROL = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"  # control tokens in a raw prompt


def test_echo_keeps_control_tokens_and_text_offset_indexes_the_echo(server, client, engine):
    ids = engine.get_tokenizer().encode(CONTROL)
    assert any(engine.get_tokenizer().is_special(t) for t in ids)
    only = post(client, COMPLETIONS, {"model": server.model, "prompt": CONTROL, "max_tokens": 0, "echo": True})
    assert only["choices"][0]["text"] == CONTROL
    for prompt in (CONTROL, ids):
        body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True,
                "logprobs": 1}
        choice = post(client, COMPLETIONS, body)["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(CONTROL), choice["text"]
        assert "".join(lp["tokens"][:len(ids)]) == CONTROL and lp["text_offset"][len(ids)] == len(CONTROL)
        assert all(choice["text"][o:o + len(t)] == t for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))
        with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]


def test_prompt_logprobs_with_echo_and_logprobs_follows_vllm(server, client):
    """vLLM's rule: the prompt's logprobs are computed with ``prompt_logprobs`` when given, else ``logprobs``; the
    legacy ``logprobs`` of the echoed prompt show at most ``logprobs`` alternatives of those (plus the prompt's own
    token), ``choices[].prompt_logprobs`` shows them all."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True}
    more = post(client, COMPLETIONS, {**body, "logprobs": 1, "prompt_logprobs": 4})["choices"][0]
    p = len(more["prompt_logprobs"])
    assert all(4 <= len(e) <= 5 for e in more["prompt_logprobs"][1:])
    assert all(1 <= len(t) <= 2 for t in more["logprobs"]["top_logprobs"][1:p])  # logprobs' count
    for e, top in zip(more["prompt_logprobs"][1:], more["logprobs"]["top_logprobs"][1:p], strict=True):
        best = max(e.values(), key=lambda x: x["logprob"])
        assert top[best["decoded_token"]] == max(-9999.0, best["logprob"])
    fewer = post(client, COMPLETIONS, {**body, "logprobs": 3, "prompt_logprobs": 1})["choices"][0]
    assert all(1 <= len(e) <= 2 for e in fewer["prompt_logprobs"][1:])
    assert all(1 <= len(t) <= 2 for t in fewer["logprobs"]["top_logprobs"][1:p])  # only those computed
    assert all(3 <= len(t) <= 4 for t in fewer["logprobs"]["top_logprobs"][p:])  # the completion: logprobs'
    plain = post(client, COMPLETIONS, {**body, "logprobs": 3})["choices"][0]  # no prompt_logprobs: logprobs'
    assert all(3 <= len(t) <= 4 for t in plain["logprobs"]["top_logprobs"][1:])
    assert all(3 <= len(e) <= 4 for e in plain["prompt_logprobs"][1:])
