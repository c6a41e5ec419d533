"""Streaming equals non-streaming, prompt forms of /v1/completions, concurrency, and the official openai client."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from server_helpers import sse_chunks

PROMPTS = {
    "english": "Describe a sunny day at the beach.",
    "chinese": "请用中文介绍一下长城。",
    "emoji": "Reply with three emoji that describe happiness 😀🎉 and explain them.",
}


def stream_text(client, path: str, body: dict) -> tuple[dict[int, str], dict[int, str], list[dict]]:
    """(text per choice index, finish reason per index, chunks) of a streamed request."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        raw = r.read().decode()
    assert r.status_code == 200, raw
    chunks = sse_chunks(raw)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            i = ch["index"]
            assert i not in reasons, "content after finish_reason"
            piece = ch["delta"].get("content") if "delta" in ch else ch["text"]
            texts[i] = texts.get(i, "") + (piece or "")
            if ch["finish_reason"] is not None:
                reasons[i] = ch["finish_reason"]
    return texts, reasons, chunks


@pytest.mark.parametrize("lang", list(PROMPTS))
def test_streamed_equals_non_streamed_chat(server, client, lang):
    body = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[lang]}], "temperature": 0,
            "max_tokens": 24}
    whole = client.post("/v1/chat/completions", json=body).json()
    texts, reasons, _ = stream_text(client, "/v1/chat/completions", body)
    choice = whole["choices"][0]
    assert texts[0] == choice["message"]["content"]
    assert reasons[0] == choice["finish_reason"]
    assert "\ufffd" not in texts[0] or "\ufffd" in choice["message"]["content"]


@pytest.mark.parametrize("lang", list(PROMPTS))
def test_streamed_equals_non_streamed_completions(server, client, lang):
    body = {"model": server.model, "prompt": PROMPTS[lang], "temperature": 0, "max_tokens": 24,
            "stream_options": {"include_usage": True}}
    whole = client.post("/v1/completions", json={k: v for k, v in body.items() if k != "stream_options"}).json()
    texts, reasons, chunks = stream_text(client, "/v1/completions", body)
    assert texts[0] == whole["choices"][0]["text"]
    assert reasons[0] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
        whole["usage"]["completion_tokens"]


def test_completions_prompt_forms_and_indexes(server, client):
    ids = client.post("/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    base = {"model": server.model, "temperature": 0, "max_tokens": 3}
    one = client.post("/v1/completions", json={**base, "prompt": "The sky is"}).json()
    by_ids = client.post("/v1/completions", json={**base, "prompt": ids}).json()
    assert by_ids["choices"][0]["text"] == one["choices"][0]["text"]
    many = client.post("/v1/completions", json={**base, "prompt": ["The sky is", "Grass is"], "n": 2}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert many["choices"][0]["text"] == one["choices"][0]["text"]
    ids2 = client.post("/tokenize", json={"prompt": "Grass is"}).json()["tokens"]
    lists = client.post("/v1/completions", json={**base, "prompt": [ids, ids2]}).json()
    assert [c["text"] for c in lists["choices"]] == [many["choices"][0]["text"], many["choices"][2]["text"]]
    assert lists["usage"]["prompt_tokens"] == len(ids) + len(ids2)
    texts, reasons, _ = stream_text(client, "/v1/completions", {**base, "prompt": ["The sky is", "Grass is"],
                                                                "n": 2})
    assert sorted(texts) == [0, 1, 2, 3] and sorted(reasons) == [0, 1, 2, 3]
    assert [texts[i] for i in range(4)] == [c["text"] for c in many["choices"]]


def test_completions_echo_and_legacy_logprobs(server, client):
    base = {"model": server.model, "prompt": "The sky is", "temperature": 0, "max_tokens": 4}
    echo = client.post("/v1/completions", json={**base, "echo": True}).json()
    plain = client.post("/v1/completions", json={**base, "logprobs": 3}).json()
    assert echo["choices"][0]["text"] == "The sky is" + plain["choices"][0]["text"]
    lp = plain["choices"][0]["logprobs"]
    n = plain["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["text_offset"][0] == 0
    assert all(off2 - off1 == len(tok) for off1, off2, tok in zip(lp["text_offset"], lp["text_offset"][1:],
                                                                   lp["tokens"], strict=False))
    for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 3 <= len(top) <= 4 and top[tok] == tlp and max(top.values()) == tlp  # greedy: chosen is the best
    texts, _, _ = stream_text(client, "/v1/completions", {**base, "echo": True})
    assert texts[0] == echo["choices"][0]["text"]


def test_openai_client(server):
    client = server.openai()
    assert [m.id for m in client.models.list()] == [server.model]
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.prompt_tokens_details.cached_tokens >= 0
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    stream = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(model=server.model, prompt="1, 2, 3,", max_tokens=4, temperature=0,
                                  extra_body={"top_k": 5, "repetition_penalty": 1.0, "min_p": 0.0})
    assert c.choices[0].text.startswith(" 4")
    extra = client.chat.completions.with_raw_response.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    timings = json.loads(extra.text)["timings"]
    assert timings["ttft_ms"] > 0 and timings["prompt_n"] > 0 and timings["queue_ms"] >= 0


def test_32_concurrent_streams(server):
    stop = threading.Event()
    running_seen: list[float] = []

    def poll_metrics() -> None:
        while not stop.is_set():
            running_seen.append(server.metrics()["vllm:num_requests_running"])

    poller = threading.Thread(target=poll_metrics, daemon=True)
    poller.start()

    async def one(client, i: int) -> tuple[str, list[dict]]:
        body = {"model": server.model, "messages": [{"role": "user", "content": f"Tell me a fact about number {i}"}],
                "max_tokens": 6, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            raw = (await r.aread()).decode()
        assert r.status_code == 200, raw
        return raw, sse_chunks(raw)

    async def main():
        async with server.async_client(limits=__import__("httpx").Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        poller.join()
    for _raw, chunks in results:
        reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert len(reasons) == 1 and reasons[0] in ("stop", "length")
    assert max(running_seen) > 1, running_seen


@pytest.mark.parametrize("lang", ["emoji", "chinese"])
def test_streamed_logprobs_follow_tokens_when_text_is_held_back(server, client, lang):
    """Byte-level tokens can split a character: those chunks carry their tokens' logprobs with content ""."""
    body = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[lang]}], "temperature": 0,
            "max_tokens": 24, "logprobs": True, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = sse_chunks(r.read().decode())
    raw, text, entries = b"", "", 0
    for c in chunks[1:-1]:
        (ch,) = c["choices"]
        if ch["finish_reason"] is not None:
            continue
        toks = ch["logprobs"]["content"]
        assert toks, "a content chunk without tokens"
        entries += len(toks)
        raw += b"".join(bytes(t["bytes"]) for t in toks)
        text += ch["delta"]["content"]
        assert raw.decode("utf-8", errors="ignore").startswith(text)  # text never runs ahead of the tokens
    assert entries == chunks[-1]["usage"]["completion_tokens"]
    plain = {k: v for k, v in body.items() if k != "stream_options"}  # stream_options needs stream: true
    whole = client.post("/v1/chat/completions", json={**plain, "stream": False}).json()
    assert text == whole["choices"][0]["message"]["content"]
