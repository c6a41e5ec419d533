"""The streaming client against scripted SSE responses (httpx.MockTransport): TTFT, ITL, usage, errors."""

from __future__ import annotations

import asyncio
import json

from leanserve.bench.client import build_payload, send_request
from leanserve.bench.workloads import BenchRequest

import httpx
import pytest

REQ = BenchRequest([{"role": "user", "content": "hi"}], "hi", prompt_len=1, max_tokens=3)


def _sse(chunks: list[tuple[float, dict | str]]):
    async def body():
        for delay, chunk in chunks:
            await asyncio.sleep(delay)
            yield f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n".encode()
    return body()


def _run(handler, endpoint="chat", count_tokens=None):
    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test") as client:
            return await send_request(client, REQ, "m", endpoint, count_tokens=count_tokens)
    return asyncio.run(main())


def _delta(text: str | None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_chat_stream_timings_and_usage():
    seen = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        return httpx.Response(200, content=_sse([
            (0.0, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
            (0.15, _delta("Hello")), (0.1, _delta(" wor")), (0.0, _delta("ld")),
            (0.0, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
            (0.0, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                            "prompt_tokens_details": {"cached_tokens": 4}}}),
            (0.0, "[DONE]")]))

    r = _run(handler)
    assert seen["path"] == "/v1/chat/completions"
    assert seen["body"]["ignore_eos"] is True and seen["body"]["stream_options"] == {"include_usage": True}
    assert r.success and r.error == ""
    assert r.generated_text == "Hello world"
    assert r.ttft >= 0.15  # the role chunk carries no text
    assert len(r.itl) == 2 and r.itl[0] >= 0.1 and r.itl[1] < 0.05
    assert r.latency >= r.ttft + sum(r.itl) - 1e-6
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens, r.usage_reported) == (9, 3, 4, True)


def test_completions_without_usage_counts_with_tokenizer():
    async def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["prompt"] == "hi"
        return httpx.Response(200, content=_sse([(0.0, {"choices": [{"index": 0, "text": "a b"}]}),
                                                 (0.0, {"choices": [{"index": 0, "text": " c"}]}), (0.0, "[DONE]")]))

    r = _run(handler, "completions", count_tokens=lambda text: len(text.split()))
    assert r.success and r.generated_text == "a b c"
    assert (r.prompt_tokens, r.output_tokens, r.usage_reported) == (1, 3, False)


def test_http_error_is_a_failed_result():
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "too many waiting"}})

    r = _run(handler)
    assert not r.success and r.error.startswith("HTTP 503") and "too many waiting" in r.error


def test_stream_without_text_fails():
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse([(0.0, _delta(None)), (0.0, "[DONE]")]))

    r = _run(handler)
    assert not r.success and r.error == "no output text in the stream"


def test_payload_rejects_unknown_endpoint():
    assert build_payload(REQ, "m", "completions")["max_tokens"] == 3
    with pytest.raises(ValueError):
        build_payload(REQ, "m", "embeddings")
