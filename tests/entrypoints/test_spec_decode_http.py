"""Speculative decoding over HTTP: a server with ``--speculative-config`` streams every accepted token (the
streamed text, logprobs and usage equal the non-streamed response), answers greedy requests exactly as the plain
server does, counts drafts in ``timings`` and ``vllm:spec_decode_*``, and honours ``"speculative": false``."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest
from server_helpers import ServerProcess, sse_chunks

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
CODE = textwrap.dedent(inspect.getsource(textwrap.indent))
MESSAGES = [{"role": "user", "content": f"Repeat this function exactly:\n\n{CODE}"}]


@pytest.fixture(scope="module")
def spec_server():
    srv = ServerProcess(["--kv-cache-memory", str(128 << 20), "--max-model-len", "1024",
                         "--speculative-config", json.dumps(SPEC)]).start()
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


def body(server, **kw) -> dict:
    return {"model": server.model, "messages": MESSAGES, "temperature": 0, "max_tokens": 64, **kw}


def streamed(client, payload: dict) -> tuple[str, list[dict], dict, str]:
    """(text, logprob entries, usage, finish_reason) of a streamed chat request with usage included."""
    with client.stream("POST", "/v1/chat/completions",
                       json={**payload, "stream": True, "stream_options": {"include_usage": True}}) as r:
        raw = r.read().decode()
    assert r.status_code == 200, raw
    chunks = sse_chunks(raw)
    text, logprobs, reason = "", [], None
    for c in chunks[:-1]:
        for ch in c["choices"]:
            text += ch["delta"].get("content") or ""
            logprobs += (ch.get("logprobs") or {}).get("content") or []
            reason = ch["finish_reason"] or reason
    return text, logprobs, chunks[-1]["usage"], reason


def test_streamed_equals_non_streamed_with_speculation(spec_server):
    payload = body(spec_server, logprobs=True, top_logprobs=2)
    with spec_server.client() as c:
        whole = c.post("/v1/chat/completions", json=payload).json()
        text, logprobs, usage, reason = streamed(c, payload)
    choice = whole["choices"][0]
    assert text == choice["message"]["content"] and reason == choice["finish_reason"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == len(logprobs)
    assert [e["token"] for e in logprobs] == [e["token"] for e in choice["logprobs"]["content"]]
    for a, b in zip(logprobs, choice["logprobs"]["content"], strict=True):
        assert abs(a["logprob"] - b["logprob"]) < 1e-4
    assert whole["timings"]["draft_n"] > 0 and 0 < whole["timings"]["draft_n_accepted"] <= whole["timings"]["draft_n"]


def test_greedy_answer_equals_the_plain_server_and_metrics_count(spec_server, server):
    with spec_server.client() as c, server.client() as plain:
        got = c.post("/v1/chat/completions", json=body(spec_server)).json()
        want = plain.post("/v1/chat/completions", json=body(server)).json()
        off = c.post("/v1/chat/completions", json=body(spec_server, speculative=False)).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert off["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert off["timings"]["draft_n"] == 0 < got["timings"]["draft_n"]
    m = spec_server.metrics()
    assert m["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == m["vllm:spec_decode_num_accepted_tokens_total"]
